"""``CompressedModel``: a causal LM whose attention reads and writes a compressed paged KV cache.

The path of one token: ``generate`` (``generation``) -> ``prefill`` / ``decode`` -> ``PagedKVCache.append`` (room,
positions, pool rows, ring slots) -> ``Programs.run`` (the rewritten graph; its ops write K/V and attend) -> after
a prefill, ``compress.compress`` keeps the budget's bytes (a ``Plan`` applied by ``PagedKVCache.keep``); while
decoding, a recipe's ``schedule.DecodeCompressor`` keeps the cache under the budget between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor, nn

from . import checks, observation, rerotation
from . import segments as segmenting
from .budget import Budget
from .cache import PagedKVCache
from .compress import compress as compress_cache
from .forking import Forking
from .generation import generate_tokens
from .kernels.formats import latent_basis
from .programs import Programs
from .recipes import Recipe
from .schedule import DecodeCompressor, DecodeSchedule
from .spec import ModelSpec
from .speculative import Speculation
from .steps import Steps


class CompressedModel(Steps, Speculation, Forking, nn.Module):
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
        self.reads_question = observation.reads_question(sources)  # a ``Question`` source: ``Steps._read_prompt``
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

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every sequence; the next ``prefill`` starts fresh."""
        self._forget()
        self._torn = False  # a call stopped half way (an interrupt, an error mid-step): only reset() mends it

    def _forget(self) -> None:
        self.cache.setup(0)
        self.context_tokens: Tensor | None = None  # [B] tokens the budget is measured against
        self.decoder: DecodeCompressor | None = None  # the decode schedule's state, from the first decode step on
        self.query_aware: bool | None = None  # how the last compression was made (see cache_stats)
        self._pending: list[tuple[Tensor, Tensor]] = []  # (ids, real) read since the last compression
        self._observing = False  # a prefill(compress=False) left a compression pending: keep observing queries

    def _start(self, batch_size: int) -> None:
        self._forget()
        self._follow_weights()
        self.cache.setup(batch_size)
        self.context_tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def budgeted_tokens(self) -> Tensor:
        """[B] the tokens a fraction budget is a share of: those read to be compressed (the context; with a scorer
        that reads the question, the context and the question it compresses together), or, once a decode-time cap
        runs, every token read so far."""
        return self.cache.seen if self.schedule is not None and self.decoder is not None else self.context_tokens

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
        schedule = self.decoder.schedule if self.decoder else self.schedule
        uncapped = self.decoder.uncapped(self.cache) if self.decoder else []
        stats.update(
            bytes_full=bytes_full, budget_bytes=budget, budget=str(self.budget), recipe=self.recipe.tag,
            query_aware=self.query_aware, tokens_held=int(self.cache.held().long().sum()),
            peak_bytes_held=stats["peak_bytes"]["payload"],
            budgeted_tokens=self.budgeted_tokens().tolist(),
            decode_schedule=None if schedule is None else dataclasses.asdict(schedule),
            decode_uncapped_rows=uncapped,
        )
        return stats

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
        with self._changing():
            return self._prefill(input_ids, real, compress, logits, segments=starts)

    def _check(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The real-token mask of a batch that extends the cache, on the device, after ``checks.tokens``."""
        return checks.tokens(input_ids, attention_mask, vocab_size=self.programs.vocab_size, rows=self.cache.batch_size
                             or None, seen=self.seen, max_positions=self.spec.max_positions).to(self.device)

    def _prefill(self, input_ids: Tensor, real: Tensor, compress: bool, logits: str, pending: bool = True,
                 segments: Tensor | None = None) -> Tensor:
        if self.seen is None:
            self._start(input_ids.shape[0])
        if segments is not None:
            self.cache.mark_segments(segments)
        if compress:
            self.context_tokens = self.context_tokens + real.sum(1)
        chunk = self.prefill_chunk or input_ids.shape[1]
        name, outs = ("prefill" if logits == "all" else "prefill_last"), []
        for start in range(0, input_ids.shape[1], chunk):
            ids, r = input_ids[:, start : start + chunk], real[:, start : start + chunk]
            outs.append(self._prefill_step(ids, r, name, compressing=compress or pending))
            self._pending.append((ids, r))
            if compress:
                self._compress()
        self._observing = pending and not compress
        if not self._observing:
            self.cache.observe(self.decode_window)  # nothing left to compress: keep what decoding reads
        if compress:
            self.query_aware = True if self.recipe.query_aware else None
        self.decoder = None  # a new turn: the decode schedule starts again at the next decode step
        return torch.cat(outs, 1) if logits == "all" else outs[-1]

    def compress(self, *, keep_last: int = 0) -> None:
        """Compress the cache to the budget now, measured against every token read so far (what ``fork`` cells
        call after a shared ``prefill(..., compress=False)``). ``keep_last``: each row's newest that many tokens (a
        question read before compressing) are kept as they are, on top of a budget measured against the tokens
        before them, which alone compete; the scorer still reads their queries."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill first")
        checks.keep_last(keep_last, int(self.seen.min()), self.recipe, self.scorer, self.allocator)
        self._refuse_compressing(torch.zeros_like(self.seen), self.seen - keep_last)
        with self._changing():
            self.context_tokens = self.cache.seen - keep_last
            self._compress(keep_last)
            self._observing = False
            self.cache.observe(self.decode_window)

    def held_positions(self) -> Tensor:
        """[L, B, Hkv, S] the original position of every entry each (layer, row, KV head) holds, -1 past its
        entries: which tokens a compression kept (read only)."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill first")
        return self.cache.positions()

    def _compress(self, apart: int = 0) -> None:
        """Compress to ``budget_bytes`` if over it, with the scorer's declared sources (always, to a page format)."""
        if (self.budget.is_full or self.scorer is None) and self.recipe.format is None:
            self._pending = []  # nothing will ever be compressed
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
        self._pending = []

    @contextlib.contextmanager
    def observing(self, dense: bool = True):
        """(the cache as the scorer sees it when it compresses, what the dense passes supplied: a dict), with its
        sources supplied (a ``Reconstruction`` source's prompt over the tokens read since the last compression is
        prefilled, and dropped on exit; ``Gradients``' backward pass and ``HiddenStates``, unless not ``dense``)."""
        ids, real = (torch.cat(x, 1) for x in zip(*self._pending)) if self._pending else (None, None)
        rerun = lambda i, r: self._prefill_step(i, r, "prefill_last", compressing=True)  # noqa: E731
        with observation.reconstructing(self.scorer, rerun, self.cache, ids, real, self.source, dense) as supplied:
            yield self.cache, supplied

    # ------------------------------------------------------------------ generation
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
        context_real, real = checks.prompt(input_ids, attention_mask, context_ids, context_mask, max_new_tokens,
                                           vocab_size=self.programs.vocab_size, max_positions=self.spec.max_positions)
        first = (input_ids, real) if context_ids is None else (context_ids, context_real)
        starts = None if segments is None else segmenting.boundaries(segments, first[0], first[1].cpu(), tokenizer)
        self._refuse_without_question(context_ids is None)
        n = first[1].sum(1) + (real.sum(1) if context_ids is not None and self.reads_question else 0)
        self._refuse_overflowing_window(n.to(self.device), n, fresh=True)
        self._check_draft(draft, draft_tokens, input_ids, attention_mask, context_ids, context_mask, max_new_tokens)
        checks.early_stop(early_stop, draft)
        self.reset()
        sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator)
        with self._changing():
            logits = self._read_prompt(input_ids, real.to(self.device), context_ids, context_real, starts)
            if self.schedule is None:  # one reservation for the whole generation (a schedule reserves its own)
                self.cache.reserve(max_new_tokens)
            eos, prompt = torch.tensor(eos, device=self.device), (input_ids, real, context_ids, context_real)
            heads = None if early_stop is None else early_stop.heads(input_ids, real)  # the answer step's start
            new = self._speculate(draft, draft_tokens, logits, max_new_tokens, eos, sampling, prompt) \
                if draft is not None else generate_tokens(self._decode, logits, max_new_tokens, eos, pad, sampling,
                                                          early_stop, heads)
        return torch.cat([input_ids.to(self.device), new], 1)

    def _fit_schedule(self, tokens: int) -> None:  # raises, before anything changes, when the cap cannot hold it
        self.schedule.fitted(int(self.cache.budget_tokens(self.budget, torch.tensor([tokens + 1]))))
