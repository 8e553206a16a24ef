"""``CompressedModel``: a causal LM whose attention reads and writes a compressed paged KV cache.

The path of one token: ``generate`` (``generation``) -> ``read_prompt`` / ``decode`` -> ``_prefill_step`` /
``_advance`` -> ``PagedKVCache.append`` (room, positions, pool rows, ring slots) -> ``Programs.run`` (the rewritten
graph; its ops write K/V and attend) -> after a prefill, ``compress.compress`` keeps the budget's bytes (a ``Plan``
applied by ``PagedKVCache.keep``); while decoding, a recipe's ``schedule.DecodeCompressor`` keeps the cache under the
budget between steps. What a request leaves between calls is one ``request.RequestState`` (``self.request``): the
step code here and its own methods are its only writers. Speculative decoding (``speculative``) is a function over
the public calls (``read_prompt``, ``decode``, ``decode_many``, ``rewind``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import Tensor, nn

from . import checks, observation, rerotation, speculative
from . import segments as segmenting
from .budget import Budget
from .cache import PagedKVCache
from .compress import check_fits
from .compress import compress as compress_cache
from .generation import generate_tokens
from .kernels.formats import get_format, latent_basis
from .programs import Programs
from .recipes import Recipe, get_recipe
from .request import RequestState
from .schedule import DecodeCompressor, DecodeSchedule
from .spec import ModelSpec
from .speculative import SpeculationStats

RESERVE_AHEAD = 64  # tokens of room a plain decode reserves at a time (allocation stays off the step)


class CompressedModel(nn.Module):
    """A causal LM over a compressed, ragged per-head paged KV cache. Build it with ``kvcompile.apply``.

    Positions keep counting the original sequence after eviction; keys are stored after RoPE (a latent format's pages:
    before it, ``kernels.latent``). The budget applies per sequence, to the tokens prefilled with ``compress=True``
    (tokens appended by ``decode`` are held on top of it, unless the recipe compresses while decoding, whose cap counts
    every token). The model's weights are its parameters (shared with the model it was applied to, as a wrapper shares
    them), so ``.to(device)`` / ``.to(dtype)`` move both; the graph is captured again for the new dtype or device.
    """

    def __init__(
        self, programs: Programs, spec: ModelSpec, recipe: Recipe, budget: Budget, *, page_size: int = 16,
        prefill_chunk: int | None = None, generation_config=None, device: torch.device | str = "cpu",
        source: nn.Module | None = None, latent_moments: list | None = None,
    ):
        super().__init__()
        self.programs, self.spec, self.recipe, self.budget = programs.for_format(recipe.format), spec, recipe, budget
        self.source, self.latent_moments = source, latent_moments  # the model applied to; a latent format's calibration
        self.scorer, self.allocator = recipe.build()
        checks.recipe(recipe, self.allocator, budget, spec, page_size)
        if self.scorer is not None:  # learned weights and calibrated tables fit this model
            self.scorer.check_model(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.hidden_size)
        rerotation.check(spec, recipe, prefill_chunk)
        self.schedule = DecodeSchedule(**recipe.decode) if recipe.decode and not budget.is_full else None
        self.prefill_chunk, self.generation_config = prefill_chunk, generation_config
        sources = self.scorer.sources() if self.scorer else ()
        self.reads_question = observation.reads_question(sources)  # a ``Question`` source: ``_read_prompt``
        observation.check(sources, f"recipe {recipe.name!r}", programs.layers)
        self.reads_dense = observation.reads_dense(sources)
        if self.reads_dense:
            checks.dense_pass(recipe, source, prefill_chunk, self.schedule, self.allocator,
                              observation.restores(sources))
        self.cache = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.num_q_heads, spec.head_dim, dtype=spec.dtype,
                                  page_size=page_size, device=device, keep_ids=observation.keeps_ids(sources),
                                  page_format=recipe.format, weighted=self.allocator.strategy.weighted,
                                  basis=latent_basis(recipe.format, latent_moments, spec.rotary, spec.head_dim))
        if self.schedule is not None and budget.kind != "fraction":  # the cap is known now: check it fits
            self._fit_schedule(0)
        self.speculation: SpeculationStats | None = None  # the last speculative generate's counts
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def seen(self) -> Tensor | None:
        """[B] tokens each row has read (the position of its next token); None when the cache is empty."""
        return self.cache.seen if self.cache.batch_size else None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] of a fresh prompt: ``reset`` then ``prefill`` (which compresses it to the budget)."""
        self.reset()
        return self.prefill(input_ids, attention_mask)

    def _apply(self, fn, *args, **kwargs):
        if self.source is None:  # a loaded artifact runs compiled code for one device and dtype
            raise ValueError("this model has no source module to move: kvcompile.load(folder, device=...) it again")
        super()._apply(fn, *args, **kwargs)
        self._follow_weights()
        return self

    def _follow_weights(self) -> None:
        """Capture again if the weights moved to another dtype or device (by ``.to()`` here or on the source)."""
        weight = next(self.source.parameters()) if self.source is not None else None
        if weight is None or self.programs.weights == (weight.dtype, weight.device):
            return
        self.spec = ModelSpec.from_model(self.source)
        programs = Programs.of(self.source, self.spec, self.programs.store)
        self.programs = programs.compile(self.programs.compiled, self.recipe.format)
        self.cache.to(device=weight.device, dtype=weight.dtype)

    # ------------------------------------------------------------------ the request
    def reset(self) -> None:
        """Forget every sequence; the next ``prefill`` starts fresh."""
        self.cache.setup(0)
        self.request = RequestState()

    def _start(self, batch_size: int) -> None:
        self.cache.setup(0)
        self._follow_weights()
        self.cache.setup(batch_size)
        self.request.start(batch_size, self.device)

    def budgeted_tokens(self) -> Tensor:
        """[B] the tokens a fraction budget is a share of: those read to be compressed (the context; with a scorer
        that reads the question, the context and the question it compresses together), or, once a decode-time cap
        runs, every token read so far."""
        decoding = self.schedule is not None and self.request.decoder is not None
        return self.cache.seen if decoding else self.request.context_tokens

    def budget_bytes(self) -> Tensor:
        """[B] bytes each sequence may hold (of ``budgeted_tokens`` for a fraction)."""
        return self.cache.budget_bytes(self.budget, self.budgeted_tokens())

    def cache_stats(self) -> dict:
        """Bytes held and allocated (``PagedKVCache.stats``), the budget, per-(layer, KV head) lengths.

        ``query_aware``: True when the compression could see the question (``generate`` without ``context_ids``,
        or a query-aware recipe), False when the context was compressed before it was read, None when ``prefill``
        compressed a prompt whose parts kvcompile was not told."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill (or generate) first")
        stats = self.cache.stats()
        bytes_full = int(self.seen.sum()) * self.spec.num_layers * self.spec.num_kv_heads * self.cache.token_bytes
        budget = None if self.budget.is_full else int(self.budget_bytes().sum())
        decoder = self.request.decoder
        schedule = decoder.schedule if decoder else self.schedule
        uncapped = decoder.uncapped(self.cache) if decoder else []
        stats.update(
            bytes_full=bytes_full, budget_bytes=budget, budget=str(self.budget), recipe=self.recipe.tag,
            query_aware=self.request.query_aware, tokens_held=int(self.cache.held().long().sum()),
            peak_bytes_held=stats["peak_bytes"]["payload"],
            budgeted_tokens=self.budgeted_tokens().tolist(),
            decode_schedule=None if schedule is None else dataclasses.asdict(schedule),
            decode_uncapped_rows=uncapped,
        )
        return stats

    def held_positions(self) -> Tensor:
        """[L, B, Hkv, S] the original position of every entry each (layer, row, KV head) holds, -1 past its
        entries: which tokens a compression kept (read only)."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill first")
        return self.cache.positions()

    @property
    def decode_window(self) -> int:
        """Queries per layer the decode schedule reads while generating (0: none, the ring is released)."""
        decoder = self.request.decoder
        schedule = decoder.schedule if decoder else self.schedule  # a small cap may have fitted it
        return schedule.observation_window if schedule else 0

    @property
    def observation_window(self) -> int:
        """Queries per layer this model reads when it compresses (its scorer's sources) or decodes."""
        scorer = observation.window(self.scorer.sources()) if self.scorer else 0
        stored = get_format(self.recipe.format).window if self.recipe.format else 0  # what its encoding reads
        return max(self.decode_window, scorer, stored)

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, compress: bool = True, logits: str = "all",
        segments=None, tokenizer=None,
    ) -> Tensor:
        """Append a prompt to the cache and return its logits: [B, T, V], or [B, 1, V] with ``logits="last"``.

        With ``compress`` (the default) the cache is compressed to the budget afterwards, and between chunks when
        ``prefill_chunk`` was set, so the cache peaks at about budget + one chunk. Left-padded batches are fine:
        padding (``attention_mask == 0``) is never stored. A later call appends (multi-turn); the budget is then
        measured against every token prefilled with ``compress=True``. With ``compress=False`` nothing is evicted
        and the observed queries are kept for a later ``compress()`` (or a ``fork`` that compresses).

        ``segments`` splits this prompt into the steps a step-level recipe keeps as units (``kvcompile.segments``):
        ``(start, end)`` spans or boundaries in its token positions, or a rule (``"blank-lines"``, ``"tool-calls"``)
        over its text, which needs ``tokenizer``.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        real = self._check(input_ids, attention_mask)
        starts = None if segments is None else segmenting.boundaries(segments, input_ids, real.cpu(), tokenizer)
        if compress:
            self._refuse_compressing(real.sum(1))
        with self.request.changing():
            return self._prefill(input_ids, real, compress, logits, segments=starts)

    def _check(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The real-token mask of a batch that extends the cache, on the device, after ``checks.tokens``."""
        return checks.tokens(input_ids, attention_mask, vocab_size=self.programs.vocab_size, rows=self.cache.batch_size
                             or None, seen=self.seen, max_positions=self.spec.max_positions).to(self.device)

    def _prefill(self, input_ids: Tensor, real: Tensor, compress: bool, logits: str, pending: bool = True,
                 segments: Tensor | None = None) -> Tensor:
        if self.seen is None:
            self._start(input_ids.shape[0])
        request = self.request
        if segments is not None:
            self.cache.mark_segments(segments)
        if compress:
            request.context_tokens = request.context_tokens + real.sum(1)
        chunk = self.prefill_chunk or input_ids.shape[1]
        name, outs = ("prefill" if logits == "all" else "prefill_last"), []
        for start in range(0, input_ids.shape[1], chunk):
            ids, r = input_ids[:, start : start + chunk], real[:, start : start + chunk]
            outs.append(self._prefill_step(ids, r, name, compressing=compress or pending))
            request.pending.append((ids, r))
            if compress:
                self._compress()
        request.deferred, request.decoded = pending and not compress, 0
        if not request.deferred:
            self.cache.observe(self.decode_window)  # nothing left to compress: keep what decoding reads
        if compress:
            request.query_aware = True if self.recipe.query_aware else None
        request.decoder = None  # a new turn: the decode schedule starts again at the next decode step
        return torch.cat(outs, 1) if logits == "all" else outs[-1]

    def _prefill_step(self, ids: Tensor, real: Tensor, name: str, compressing: bool) -> Tensor:
        step = self.cache.append(real, observe=self.observation_window if compressing else self.decode_window, ids=ids)
        return self.programs.run(name, ids.to(self.device), step, self.cache)

    def compress(self, *, keep_last: int = 0) -> None:
        """Compress the cache to the budget now, measured against every token read so far (what ``fork`` cells
        call after a shared ``prefill(..., compress=False)``). ``keep_last``: each row's newest that many tokens (a
        question read before compressing) are kept as they are, on top of a budget measured against the tokens
        before them, which alone compete; the scorer still reads their queries."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill first")
        checks.keep_last(keep_last, int(self.seen.min()), self.recipe, self.scorer, self.allocator)
        self._refuse_compressing(torch.zeros_like(self.seen), self.seen - keep_last)
        with self.request.changing():
            self.request.context_tokens = self.cache.seen - keep_last
            self._compress(keep_last)
            self.request.deferred, self.request.decoded = False, 0
            self.cache.observe(self.decode_window)

    def _compress(self, apart: int = 0) -> None:
        """Compress to ``budget_bytes`` if over it, with the scorer's declared sources (always, to a page format)."""
        if (self.budget.is_full or self.scorer is None) and self.recipe.format is None:
            self.request.pending = []  # nothing will ever be compressed
            return
        budget = self.budget_bytes()
        if not bool((self.cache.bytes_held() > budget).any()) and self.recipe.format is None:
            return
        seen = self.cache.seen.clone()  # the next query's position (a reconstruction prompt is appended and dropped)
        with self.observing() as (cache, dense):
            compress_cache(cache, self.scorer, self.allocator, budget, self.programs.layers, self.recipe, apart, seen,
                           dense)
            if self.recipe.rerotate_keys:
                rerotation.rerotate(cache, self.spec)
        self.request.pending = []

    @contextlib.contextmanager
    def observing(self, dense: bool = True):
        """(the cache as the scorer sees it when it compresses, what the dense passes supplied: a dict), with its
        sources supplied (a ``Reconstruction`` source's prompt over the tokens read since the last compression is
        prefilled, and dropped on exit; ``Gradients``' backward pass and ``HiddenStates``, unless not ``dense``)."""
        pending = self.request.pending
        ids, real = (torch.cat(x, 1) for x in zip(*pending)) if pending else (None, None)
        rerun = lambda i, r: self._prefill_step(i, r, "prefill_last", compressing=True)  # noqa: E731
        with observation.reconstructing(self.scorer, rerun, self.cache, ids, real, self.source, dense) as supplied:
            yield self.cache, supplied

    # ------------------------------------------------------------------ decode
    def decode(self, input_ids: Tensor) -> Tensor:
        """Append one token per sequence ([B, 1]) and return its logits [B, 1, V]."""
        if self.seen is None:
            raise RuntimeError("decode needs a prefilled cache: call prefill first")
        if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, got input_ids of shape {tuple(input_ids.shape)}")
        real = self._check(input_ids)
        with self.request.changing():
            return self._decode(input_ids, real)

    def _decode(self, input_ids: Tensor, real: Tensor | None = None) -> Tensor:
        self._begin_decoding()
        return self._advance("decode", input_ids, real)

    def decode_many(self, input_ids: Tensor) -> Tensor:
        """Append T known tokens per sequence ([B, T]) exactly as T ``decode`` calls would; returns logits [B, T, V].

        For teacher forcing (scoring a known continuation) at a fraction of the cost: the prefill program reads the
        tokens a segment at a time, each segment ending where the decode schedule runs, so every token sees the
        cache that T ``decode`` calls would have shown it (up to floating-point summation order).
        """
        if self.seen is None:
            raise RuntimeError("decode_many needs a prefilled cache: call prefill first")
        real, outs, start, T = self._check(input_ids), [], 0, input_ids.shape[1]
        with self.request.changing():
            self._begin_decoding()
            while start < T:
                n = min(T - start, self._until_maintenance() or T)
                outs.append(self._advance("prefill", input_ids[:, start : start + n], real[:, start : start + n]))
                start += n
        return torch.cat(outs, 1)

    def _until_maintenance(self) -> int | None:
        """Decode steps from now up to and including the one after which the cache is next compressed or demoted
        (None: never)."""
        if self.request.decoder is not None:
            return self.request.decoder.until_run()
        window = self.recipe.precise_recent
        return max(window - self.cache.appended, 1) if window else None

    def _begin_decoding(self) -> None:
        if self.request.decoder is None and self.schedule is not None:  # decoding starts: the cap holds from here on
            decoder = DecodeCompressor(self.schedule, self.budget, self.programs.layers)
            decoder.start(self.cache)
            self.request.decoder = decoder

    def _advance(self, name: str, input_ids: Tensor, real: Tensor | None) -> Tensor:
        """Append ``input_ids`` [B, n] as n decode steps (no schedule run falls inside them), then run it if due."""
        if real is None:
            real = torch.ones(input_ids.shape, dtype=torch.bool, device=self.device)
        request = self.request
        ahead = 1 if request.decoder is not None else RESERVE_AHEAD  # a schedule reserves its own room
        observe = self.observation_window if request.deferred else self.decode_window
        step = self.cache.append(real, observe=observe, reserve_ahead=ahead, ids=input_ids)
        logits = self.programs.run(name, input_ids.to(self.device), step, self.cache)
        request.decoded += input_ids.shape[1]
        if request.decoder is not None:
            request.decoder.step(self.cache, input_ids.shape[1])
        elif self.recipe.precise_recent and self.cache.appended >= self.recipe.precise_recent:
            # the tokens that left the window go to the format: at most 2 x precise_recent stay in the model dtype
            self.cache.demote(self.recipe.precise_recent, shrink=False, anchors=self.recipe.precise_anchors)
        return logits

    def rewind(self, n: int) -> None:
        """Take back the last ``n`` tokens of every row, as if they had never been read (a speculative target's and
        draft's rejected proposals). Only tokens decoded since the last prompt or ``compress`` can go back (they are
        each head's tail, so nothing is compacted), and only under a recipe that leaves its cache alone while
        decoding; anything else is refused, naming it, with the cache as it was."""
        if self.seen is None:
            raise RuntimeError("rewind needs a prefilled cache: call prefill first")
        checks.count("rewind's n", n)
        checks.rewinds("this model", self.recipe, self.schedule)
        if n > self.request.decoded:
            raise ValueError(f"rewind takes back only tokens decoded since the last prompt or compression, "
                             f"{self.request.decoded} here, not {n}")
        with self.request.changing():
            self.cache.rewind(self.cache.seen - n)
            self.request.decoded -= n

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def read_prompt(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, context_ids: Tensor | None = None,
        context_mask: Tensor | None = None, max_new_tokens: int = 0, segments=None, tokenizer=None,
    ) -> Tensor:
        """Start a request as ``generate`` does and return the prompt's last logits [B, 1, V]: ``reset``, then
        ``context_ids`` (when given) read and compressed before ``input_ids`` (the question) is read, with room for
        ``max_new_tokens`` tokens decoded after it. ``generate`` is this, then a decode loop; ``speculative`` starts
        the draft with it. Its arguments are ``generate``'s, refused as it refuses them, before anything changes."""
        checks.count("max_new_tokens", max_new_tokens)
        context_real, real, starts = self._checked_prompt(input_ids, attention_mask, context_ids, context_mask,
                                                          max_new_tokens, segments, tokenizer)
        self.reset()
        with self.request.changing():
            return self._read_prompt(input_ids, real, context_ids, context_real, starts, max_new_tokens)

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, context_ids: Tensor | None = None,
        context_mask: Tensor | None = None, max_new_tokens: int = 32, do_sample: bool = False,
        temperature: float = 1.0, top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None, generator: torch.Generator | None = None,
        draft: CompressedModel | None = None, draft_tokens: int = 4, segments=None, tokenizer=None,
        early_stop=None,
    ) -> Tensor:
        """Generate up to ``max_new_tokens`` after ``input_ids``; returns [B, T + new] (input then new tokens).

        With ``context_ids``, the context is prefilled and compressed *before* ``input_ids`` (the question) is read,
        so no ranking can see the question (query-agnostic), except a scorer that reads the ``Question`` source,
        which compresses both after the question. Without it, ``input_ids`` itself is compressed after prefill
        (``cache_stats()["query_aware"]`` is then True). Finished rows are padded with ``pad_token_id`` (default:
        the first eos id). With a ``draft`` (another ``CompressedModel`` over the same vocabulary, one sequence),
        decoding is speculative (``speculative``): the draft proposes ``draft_tokens`` at a time, this model verifies
        them in one call and rolls both caches back; the output is distributed as this model's alone.
        ``segments`` (and ``tokenizer`` for a rule) split the prompt read first, ``context_ids`` when given, else
        ``input_ids``, as ``prefill`` takes them. ``early_stop``: an ``EarlyStop`` (no ``draft``).
        """
        if eos_token_id is None and self.generation_config is not None:
            eos_token_id = self.generation_config.eos_token_id
        eos = checks.generation(max_new_tokens, do_sample, temperature, top_p, eos_token_id, pad_token_id, generator)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        context_real, real, starts = self._checked_prompt(input_ids, attention_mask, context_ids, context_mask,
                                                          max_new_tokens, segments, tokenizer)
        speculative.check_draft(self, draft, draft_tokens, input_ids)
        checks.early_stop(early_stop, draft)
        sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator)
        if draft is not None:  # first: a prompt the draft refuses changes neither model
            draft.read_prompt(input_ids, attention_mask, context_ids=context_ids, context_mask=context_mask,
                              max_new_tokens=max_new_tokens)
        self.reset()
        with self.request.changing():
            logits = self._read_prompt(input_ids, real, context_ids, context_real, starts, max_new_tokens)
        eos = torch.tensor(eos, device=self.device)
        if draft is not None:  # the rounds make public calls of both models, each a change of its own
            self.speculation = stats = SpeculationStats()
            new = speculative.speculate(self, draft, draft_tokens, logits, max_new_tokens, eos, sampling, stats)
        else:
            heads = None if early_stop is None else early_stop.heads(input_ids, real)  # the answer step's start
            with self.request.changing():
                new = generate_tokens(self._decode, logits, max_new_tokens, eos, pad, sampling, early_stop, heads)
        return torch.cat([input_ids.to(self.device), new], 1)

    def _checked_prompt(self, input_ids, attention_mask, context_ids, context_mask, max_new_tokens: int, segments,
                        tokenizer) -> tuple[Tensor | None, Tensor, Tensor | None]:
        """(the context's real mask or None, the question's, the first part's segment starts or None) of a prompt
        read as ``generate`` reads it, after checking it and refusing what its compression could not do."""
        context_real, real = checks.prompt(input_ids, attention_mask, context_ids, context_mask, max_new_tokens,
                                           vocab_size=self.programs.vocab_size, max_positions=self.spec.max_positions)
        first = (input_ids, real) if context_ids is None else (context_ids, context_real)
        starts = None if segments is None else segmenting.boundaries(segments, first[0], first[1].cpu(), tokenizer)
        self._refuse_without_question(context_ids is None)
        n = first[1].sum(1) + (real.sum(1) if context_ids is not None and self.reads_question else 0)
        self._refuse_overflowing_window(n.to(self.device), n, fresh=True)
        return context_real, real, starts

    def _read_prompt(self, input_ids: Tensor, real: Tensor, context_ids: Tensor | None, context_real: Tensor | None,
                     segments: Tensor | None, max_new_tokens: int) -> Tensor:
        """``read_prompt`` once checked, on a reset model; returns the last logits. The context, when given, is
        compressed before the question is read. A scorer that reads the ``Question`` source instead reads the context
        unobserved and the question observed, then compresses both, the budget counting both: its window holds the
        question's queries alone."""
        asks, real = self.reads_question, real.to(self.device)
        if context_ids is not None:
            context_real = context_real.to(self.device)
            self._prefill(context_ids, context_real, not asks, "last", pending=not asks, segments=segments)
            if asks:  # the budget counts the context too
                self.request.context_tokens = self.request.context_tokens + context_real.sum(1)
        logits = self._prefill(input_ids, real, context_ids is None or asks, "last", pending=False,
                               segments=segments if context_ids is None else None)
        self.request.query_aware = context_ids is None or self.recipe.query_aware
        if self.schedule is None:  # one reservation for the whole generation (a schedule reserves its own)
            self.cache.reserve(max_new_tokens)
        return logits

    def _fit_schedule(self, tokens: int) -> None:  # raises, before anything changes, when the cap cannot hold it
        self.schedule.fitted(int(self.cache.budget_tokens(self.budget, torch.tensor([tokens + 1]))))

    # ------------------------------------------------------------------ fork
    def fork(self, recipe: str | Recipe | None = None, budget: float | int | str | None = None, *,
             compile=None) -> CompressedModel:
        """A copy of this model's cache and request, retargeted to ``recipe`` / ``budget``, over the same programs:
        one ``prefill(context, compress=False)``, then ``fork(recipe, budget).compress()`` per cell. Only the cache
        is copied. ``compile``: the copy runs compiled (``True`` or a backend) or eager (``False``); None: as this
        model does. With a compression pending, the target may read at most the queries this cache kept."""
        recipe = self.recipe if recipe is None else get_recipe(recipe)
        checks.same_adapter(recipe, self.recipe)
        budget = self.budget if budget is None else Budget.parse(budget)
        programs = self.programs if compile is None else self.programs.compile(compile)
        chunk = recipe.prefill_chunk or self.prefill_chunk
        child = type(self)(programs, self.spec, recipe, budget, page_size=self.cache.page_size, prefill_chunk=chunk,
                           generation_config=self.generation_config, device=self.device, source=self.source,
                           latent_moments=self.latent_moments)
        if self.seen is None:
            return child
        checks.same_chunking(recipe.name, chunk, self.prefill_chunk)
        window, kept = child.observation_window, self.cache.ring.capacity
        if self.request.deferred and window > kept and kept < int(self.seen.max()):
            raise ValueError(f"recipe {recipe.name!r} reads the last {window} queries of each layer but this cache "
                             f"kept {kept}; prefill the shared context with compress=False under the widest-window "
                             "recipe")
        if child.cache.keep_ids > self.cache.keep_ids:
            raise ValueError(f"recipe {recipe.name!r} reads the token ids of the context, which this cache did not log")
        weighted, basis, child.cache = child.cache.weighted, child.cache.fmt_basis, copy.deepcopy(self.cache)
        child.cache.set_format(recipe.format, basis if basis.shape[1] else None)
        child.cache.set_weighted(weighted)
        same = (recipe, budget) == (self.recipe, self.budget)  # the decode schedule's state carries over
        child.request = self.request.copy(self.programs.layers if same else None)
        child.cache.observe(window)
        return child

    # ------------------------------------------------------------------ refusals, before anything changes
    def _refuse_without_question(self, compressing: bool = True) -> None:
        """Raise when a scorer that ranks by the question would compress without it."""
        if compressing and self.reads_question and not self.budget.is_full:
            raise ValueError(f"recipe {self.recipe.name!r} ranks the context by the question's queries: give the "
                             "question apart, generate(question_ids, context_ids=context_ids)")

    def _refuse_compressing(self, read: Tensor, budget_tokens: Tensor | None = None) -> None:
        """Raise when a compression after reading ``read`` [B] more tokens cannot go as asked; its budget is measured
        against ``budget_tokens`` [B] (default: the context read so far and ``read``)."""
        fresh = self.seen is None
        self._refuse_without_question()
        if not fresh:
            self._refuse_partial_replay()
        if budget_tokens is None:
            context = self.request.context_tokens
            budget_tokens = read if fresh else context + read.to(context)
        self._refuse_overflowing_window(read, budget_tokens, fresh)

    def _refuse_unrestorable(self, budget_tokens: Tensor) -> None:
        """Raise when a budget cannot hold a page for the restore entries of every (layer, KV head) (``Restore``:
        they are kept, and charged, whatever else is evicted)."""
        n = observation.restores(self.scorer.sources()) if self.scorer is not None and not self.budget.is_full else 0
        if not n:
            return
        cache, P = self.cache, self.cache.page_size
        need = cache.num_layers * cache.num_kv_heads * -(-n // P) * cache.page_bytes
        budget = int(cache.budget_bytes(self.budget, budget_tokens.cpu()).min())
        if budget < need:
            raise ValueError(f"recipe {self.recipe.name!r} keeps {n} restore entries in every (layer, KV head): "
                             f"{need} bytes in pages of {P}; the budget holds {budget} bytes for this context: raise "
                             "the budget or read a longer context")

    def _refuse_overflowing_window(self, read: Tensor, budget_tokens: Tensor, fresh: bool) -> None:
        """Raise when a format recipe's compression could not hold the budget once ``read`` [B] more tokens are read
        (``compress.check_fits``), or a restoring recipe's (``_refuse_unrestorable``)."""
        self._refuse_unrestorable(budget_tokens)
        if self.recipe.format is None:  # nothing to check: no budget is worked out for a prefill that cannot fail
            return
        seen = read if fresh else self.seen + read.to(self.seen)
        check_fits(self.cache, self.recipe, self.scorer, self.cache.budget_bytes(self.budget, budget_tokens),
                   seen, fresh)

    def _refuse_partial_replay(self) -> None:
        """Raise when a scorer's dense pass (``Gradients``, ``HiddenStates``) could not replay every token the cache
        holds: some were compressed before."""
        if self.reads_dense and self.seen is not None and not self.budget.is_full:
            pending = sum((r.sum(1) for _, r in self.request.pending), torch.zeros_like(self.seen))
            if not torch.equal(pending.to(self.seen), self.seen):
                raise ValueError(f"recipe {self.recipe.name!r} runs a dense pass over every token the cache read, "
                                 "but this cache was compressed before: reset() and read the context in one prefill")
