"""``CompressedModel``: prefill, decode and generate over the paged cache, compressing per the recipe.

The path of one token: ``generate`` -> ``prefill`` / ``decode`` -> ``_step`` (reserve pages, compute positions and
pool rows) -> the rewritten program (``passes.rewrite``), whose kvcompile ops write K/V into the cache and attend
-> after a prefill, ``compress.compress`` keeps the budget's bytes; while decoding, a recipe's decode schedule
(``schedule.DecodeCompressor``) keeps the cache under the budget between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, fx, nn

from . import ops, passes
from .budget import Budget
from .cache import PagedKVCache
from .compress import compress as compress_cache
from .recipes import Recipe
from .schedule import DecodeCompressor, DecodeSchedule
from .spec import ModelSpec

_DECODE_RESERVE = 64  # tokens of room reserved at a time while decoding (allocation stays off the step)


@dataclass
class Programs:
    """The two programs a ``CompressedModel`` runs, and what they were made from.

    ``prefill`` / ``prefill_last`` / ``decode``: ``(input_ids, position_ids, q_pos, slots, *cache tensors) ->
    logits`` (eager FX graphs, their compiled versions, or loaded AOTInductor packages); ``prefill_last`` returns
    only the last position's logits (what generation needs); ``scales``: the softmax scale per layer;
    ``captured``: the captured model graph, kept so a new recipe or budget needs no new capture;
    ``decode_packed``: the decode program for a packed cache (``PagedKVCache.packed``), which reads each layer's
    pages in place instead of gathering them (None: ``decode`` serves every layout, as in an exported artifact).
    """

    prefill: Callable
    prefill_last: Callable
    decode: Callable
    scales: list[float]
    captured: fx.GraphModule | None = None
    decode_packed: Callable | None = None

    NAMES = ("prefill", "prefill_last", "decode")

    @classmethod
    def rewrite(
        cls, captured: fx.GraphModule, spec: ModelSpec, compile=False, stream_weights: bool | None = None
    ) -> "Programs":
        """``stream_weights``: decode's projections as ``streamed_linear`` (default: on CPU)."""
        cuda = next(captured.parameters()).device.type == "cuda"
        stream = not cuda if stream_weights is None else stream_weights
        prefill = passes.rewrite(captured, spec, decode=False)
        prefill_last = passes.rewrite(captured, spec, decode=False, last_logits=True)
        decode = passes.rewrite(captured, spec, decode=True, stream_weights=stream)
        decode_packed = passes.rewrite(captured, spec, decode=True, packed=True, stream_weights=stream)
        scales = [0.0] * spec.num_layers
        for node in prefill.graph.nodes:
            if "kvc.layer" in node.meta:
                scales[node.meta["kvc.layer"]] = node.kwargs["scale"]
        if compile:
            backend = "inductor" if compile is True else compile
            prefill, prefill_last = (torch.compile(p, backend=backend, fullgraph=True, dynamic=True)
                                     for p in (prefill, prefill_last))
            # static shapes: lengths change values, not shapes, so decode compiles once; CUDA graphs on CUDA
            # (mode="reduce-overhead", not yet run on a GPU)
            mode = "reduce-overhead" if cuda and backend == "inductor" else None
            decode, decode_packed = (torch.compile(p, backend=backend, fullgraph=True, dynamic=False, mode=mode)
                                     for p in (decode, decode_packed))
        return cls(prefill, prefill_last, decode, scales, captured, decode_packed)


class CompressedModel(nn.Module):
    """A causal LM whose attention reads and writes a compressed, ragged per-head paged KV cache.

    Build it with ``kvcompile.apply``. Positions keep counting the original sequence after eviction; keys are
    stored after RoPE. The budget applies per sequence, to the context compressed by ``prefill`` (tokens appended
    by ``decode`` are held on top of it).
    """

    def __init__(
        self,
        programs: "Programs",
        spec: ModelSpec,
        recipe: Recipe,
        budget: Budget,
        *,
        page_size: int = 16,
        prefill_chunk: int | None = None,
        generation_config=None,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.programs, self.spec, self.recipe, self.budget = programs, spec, recipe, budget
        self.scorer, self.allocator = recipe.build()
        self.prefill_chunk = prefill_chunk
        self.generation_config = generation_config
        schedule = self._schedule()  # the ops also keep the queries a decode policy reads
        window = max(self.scorer.observation_window if self.scorer else 0,
                     schedule.observation_window if schedule else 0)
        self.cache = PagedKVCache(
            spec.num_layers, spec.num_kv_heads, spec.num_q_heads, spec.head_dim,
            dtype=spec.dtype, page_size=page_size, obs_window=window, device=device,
        )
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.cache.device

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every sequence; the next ``prefill`` starts fresh."""
        self.seen: Tensor | None = None  # [B] tokens each row has read (the next position)
        self.context_tokens: Tensor | None = None  # [B] tokens the budget is measured against
        self.peak_bytes_held = 0
        self._room = 0  # tokens every head can still take without reserving pages
        self.decoder: DecodeCompressor | None = None  # the decode schedule's state, from the first decode step on
        self._max_seen = 0  # host copy of seen.max(), so decode checks lengths without a device sync
        self._last_chunk: tuple[Tensor, Tensor] | None = None  # last (ids, real) compressed; KVzip re-reads it

    def _schedule(self) -> DecodeSchedule | None:
        """The recipe's decode schedule; None when there is none or the budget keeps everything."""
        if self.recipe.decode is None or self.budget.is_full:
            return None
        return DecodeSchedule(**self.recipe.decode)

    def _budget_bytes(self) -> Tensor:
        per_row = [
            self.budget.bytes_per_sequence(int(n), self.spec.num_layers, self.spec.num_kv_heads, self.cache.token_bytes)
            for n in self.context_tokens
        ]
        return torch.tensor(per_row, dtype=torch.long, device=self.device)

    def cache_stats(self) -> dict:
        """Bytes held, the budget, and per-(layer, KV head) lengths; see ``PagedKVCache.stats``."""
        if self.seen is None:
            raise RuntimeError("the cache is empty: call prefill (or generate) first")
        stats = self.cache.stats()
        held = self.cache.lengths.long().sum()
        stats.update(
            bytes_full=int(self.seen.sum()) * self.spec.num_layers * self.spec.num_kv_heads * self.cache.token_bytes,
            budget_bytes=int(self._budget_bytes().sum()) if not self.budget.is_full else None,
            budget=str(self.budget),
            recipe=self.recipe.tag,
            query_aware=self.recipe.query_aware,
            tokens_held=int(held),
            peak_bytes_held=max(self.peak_bytes_held, stats["bytes_held"]),  # decode grows it until the next run
        )
        return stats

    # ------------------------------------------------------------------ checks
    def _check_tokens(
        self, input_ids: Tensor, attention_mask: Tensor | None, *, fresh: bool = False, extra: int = 0
    ) -> Tensor:
        """Validate a batch (against an empty cache if ``fresh``, with ``extra`` tokens still to come); return the
        real-token mask [B, T] (bool). Raises before anything is changed."""
        current = None if fresh else self.seen
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError("input_ids must be an integer tensor of shape [batch, tokens]")
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
        if current is not None and B != current.shape[0]:
            raise ValueError(f"batch size {B} does not match the {current.shape[0]} sequences in the cache; call reset()")
        if attention_mask is None:
            real = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
                )
            if not ((attention_mask == 0) | (attention_mask == 1)).all():
                raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
            real = attention_mask.bool()
        if current is None and not real.any(1).all():
            raise ValueError("a sequence in the batch has no tokens (its attention_mask row is all zeros)")
        before = 0 if current is None else self._max_seen
        if attention_mask is None:  # every row gets T tokens: no device sync on the decode path
            longest = before + T + extra
        else:
            seen = torch.zeros(B, dtype=torch.long) if current is None else current.cpu()
            longest = int((seen + real.sum(1).cpu()).max()) + extra
        limit = self.spec.max_positions
        if limit is not None and longest > limit:
            raise ValueError(
                f"sequence too long: {longest} positions (including tokens still to generate), "
                f"the model has {limit} (max_position_embeddings)"
            )
        return real.to(self.device)

    # ------------------------------------------------------------------ steps
    def _step(self, program: Callable, input_ids: Tensor, real: Tensor) -> Tensor:
        n_new = real.sum(1)
        pos = self.seen[:, None] + real.long().cumsum(1) - 1
        q_pos = pos.masked_fill(~real, -1)
        slots = self.cache.slots_for(real)
        self.cache.lengths += n_new.to(torch.int32)[None, :, None]
        W, decode = self.cache.obs_window, program is self.programs.decode
        if W and decode:  # one real query per row: its slot in place, like the op
            self.cache.obs_pos.scatter_(1, q_pos % W, q_pos)
        elif W:  # the ops keep their last W queries in a ring (``ops.ring_slots``); the positions follow them
            self.cache.obs_pos = ops.ring_write(self.cache.obs_pos, ops.ring_slots(q_pos, W), q_pos, dim=1)
        if decode and self.programs.decode_packed is not None and self.cache.packed():
            program = self.programs.decode_packed  # reads each layer's pages in place: no gather
        with torch.no_grad():
            cache = [getattr(self.cache, name) for name in passes.CACHE_BUFFERS]
            logits = program(input_ids.to(self.device).contiguous(), pos.clamp_min(0), q_pos, slots, *cache)
        self.seen = self.seen + n_new
        return logits

    def _start(self, batch_size: int) -> None:
        self.reset()
        self.cache.setup(batch_size)
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.context_tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def prefill(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, compress: bool = True, logits: str = "all"
    ) -> Tensor:
        """Append a prompt to the cache and return its logits: [B, T, V], or [B, 1, V] with ``logits="last"``.

        With ``compress`` (the default) the cache is compressed to the budget afterwards, and between chunks when
        ``prefill_chunk`` was set, so the cache peaks at about budget + one chunk. Left-padded batches are fine:
        padding (``attention_mask == 0``) is never stored. A later call appends (multi-turn); the budget is then
        measured against every token prefilled with ``compress=True``.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        real = self._check_tokens(input_ids, attention_mask)
        if self.seen is None:
            self._start(input_ids.shape[0])
        if compress:
            self.context_tokens = self.context_tokens + real.sum(1)
        chunk = self.prefill_chunk or input_ids.shape[1]
        outs = []
        for start in range(0, input_ids.shape[1], chunk):
            ids, r = input_ids[:, start : start + chunk], real[:, start : start + chunk]
            self.cache.reserve(r.sum(1))
            program = self.programs.prefill if logits == "all" else self.programs.prefill_last
            outs.append(self._step(program, ids, r))
            self.peak_bytes_held = max(self.peak_bytes_held, int(self.cache.bytes_held().sum()))  # before compression
            if compress:
                self._last_chunk = (ids, r)
                self._compress()
        self._room = 0
        self.decoder = None  # a new turn: the decode schedule starts again at the next decode step
        self._max_seen = int(self.seen.max())
        return torch.cat(outs, 1) if logits == "all" else outs[-1]

    def _compress(self) -> None:
        if self.budget.is_full or self.scorer is None:
            return
        budget = self._budget_bytes()
        if not bool((self.cache.bytes_held() > budget).any()):
            return
        seen = self.seen
        prompt = None if self._last_chunk is None else self.scorer.reconstruction_prompt(*self._last_chunk)
        if prompt is not None:
            self._reconstruct(*prompt)
        compress_cache(self.cache, self.scorer, self.allocator, budget, self.programs.scales, self.spec.windows)
        if prompt is not None:
            self._drop_from(seen)

    def _reconstruct(self, ids: Tensor, real: Tensor) -> None:
        """Prefill a scorer's reconstruction prompt (KVzip) after the context, its queries alone in the observation
        window. Its tokens are appended like any others; ``_drop_from`` removes them after compression."""
        self.cache.obs_pos.fill_(-1)
        real = real.to(self.device)
        self.cache.reserve(real.sum(1))
        self._step(self.programs.prefill_last, ids, real)
        self.peak_bytes_held = max(self.peak_bytes_held, int(self.cache.bytes_held().sum()))

    def _drop_from(self, seen: Tensor) -> None:
        """Forget every held token at position >= ``seen`` [B] and rewind to it. Kept tokens are in position order,
        so those are each head's tail: shortening the lengths drops them, and their pages are released."""
        for layer in range(self.spec.num_layers):
            _, _, positions, valid = self.cache.dense(layer)
            self.cache.lengths[layer] = (valid & (positions < seen[:, None, None])).sum(-1).to(torch.int32)
        self.cache.release_unused()
        self.cache.trim()
        self.cache.obs_pos.fill_(-1)
        self.seen = seen

    def decode(self, input_ids: Tensor) -> Tensor:
        """Append one token per sequence ([B, 1]) and return its logits [B, 1, V]."""
        if self.seen is None:
            raise RuntimeError("decode needs a prefilled cache: call prefill first")
        real = self._check_tokens(input_ids, None)
        if input_ids.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, got input_ids of shape {tuple(input_ids.shape)}")
        self._begin_decoding()
        return self._advance(self.programs.decode, input_ids, real)

    def decode_many(self, input_ids: Tensor) -> Tensor:
        """Append T known tokens per sequence ([B, T]) exactly as T ``decode`` calls would; returns logits [B, T, V].

        For teacher forcing (scoring a known continuation) at a fraction of the cost: the prefill program reads the
        tokens a segment at a time, each segment ending where the decode schedule runs, so every token sees the
        cache that T ``decode`` calls would have shown it (up to floating-point summation order).
        """
        if self.seen is None:
            raise RuntimeError("decode_many needs a prefilled cache: call prefill first")
        real = self._check_tokens(input_ids, None)
        self._begin_decoding()
        outs, start, T = [], 0, input_ids.shape[1]
        while start < T:
            n = T - start if self.decoder is None else min(T - start, self.decoder.until_run())
            segment = slice(start, start + n)
            outs.append(self._advance(self.programs.prefill, input_ids[:, segment], real[:, segment]))
            start += n
        return torch.cat(outs, 1)

    def _begin_decoding(self) -> None:
        if self.decoder is None and (schedule := self._schedule()) is not None:  # decoding starts: the cap holds
            self.decoder = DecodeCompressor(schedule, self.budget, self.programs.scales, self.spec.windows)
            self._room = self.decoder.start(self.cache, self.seen)

    def _advance(self, program: Callable, input_ids: Tensor, real: Tensor) -> Tensor:
        """Append ``input_ids`` [B, n] as n decode steps (no schedule run falls inside them), then run it if due."""
        n = input_ids.shape[1]
        if self._room < n:
            self.cache.reserve(max(_DECODE_RESERVE, n))
            self._room = max(_DECODE_RESERVE, n)
        self._room -= n
        self._max_seen += n
        logits = self._step(program, input_ids, real)
        if self.decoder is not None and (held := self.decoder.step(self.cache, self.seen, n)) is not None:
            self.peak_bytes_held = max(self.peak_bytes_held, held)  # what the cache held just before this run
            self._room = self.decoder.schedule.every
        return logits

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context_ids: Tensor | None = None,
        context_mask: Tensor | None = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Generate up to ``max_new_tokens`` after ``input_ids``; returns [B, T + new] (input then new tokens).

        With ``context_ids``, the context is prefilled and compressed *before* ``input_ids`` (the question) is read,
        so no ranking can see the question (query-agnostic). Without it, ``input_ids`` itself is compressed
        after prefill. Finished rows are padded with ``pad_token_id`` (default: the first eos id).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if do_sample and (temperature <= 0 or not 0 < top_p <= 1):
            raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if eos_token_id is None and self.generation_config is not None:
            eos_token_id = self.generation_config.eos_token_id
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=self.device)
        pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)
        self._check_tokens(input_ids, attention_mask, fresh=True, extra=max_new_tokens)
        if context_ids is not None:
            if context_ids.dim() != 2 or context_ids.shape[0] != input_ids.shape[0]:
                raise ValueError("context_ids must be [batch, tokens] with the same batch size as input_ids")
            whole = torch.cat([context_ids, input_ids], 1)
            whole_mask = None
            if context_mask is not None or attention_mask is not None:
                whole_mask = torch.cat([
                    context_mask if context_mask is not None else torch.ones_like(context_ids),
                    attention_mask if attention_mask is not None else torch.ones_like(input_ids),
                ], 1)
            self._check_tokens(context_ids, context_mask, fresh=True)
            self._check_tokens(whole, whole_mask, fresh=True, extra=max_new_tokens)
        self.reset()
        if context_ids is not None:
            self.prefill(context_ids, context_mask, logits="last")
            logits = self.prefill(input_ids, attention_mask, compress=False, logits="last")
        else:
            logits = self.prefill(input_ids, attention_mask, logits="last")
        if self._schedule() is None:  # one reservation for the whole generation (a decode schedule reserves its own)
            self.cache.reserve(max_new_tokens)
            self._room = max_new_tokens
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=self.device)
        new = []
        for step in range(max_new_tokens):
            token = self._next_token(logits[:, -1], do_sample, temperature, top_p, generator)
            token = token.masked_fill(done, pad)
            new.append(token)
            done |= torch.isin(token, eos)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            logits = self.decode(token[:, None])
        return torch.cat([input_ids.to(self.device), torch.stack(new, 1)], 1)

    @staticmethod
    def _next_token(logits: Tensor, do_sample, temperature, top_p, generator) -> Tensor:
        if not do_sample:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, -1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p > top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    # ------------------------------------------------------------------ forking
    def fork(self, recipe: str | Recipe | None = None, budget: float | int | str | None = None) -> "CompressedModel":
        """A copy of this model's cache and counters, retargeted to ``recipe`` / ``budget``, over the same programs.

        Lets one prefill serve many (recipe, budget) cells: prefill the context once at ``budget=1.0`` with the
        widest observation window any recipe needs, then ``fork`` per cell and compress (``_compress``). Nothing
        is captured or rewritten again; only the cache is copied. The fork's observation window must not exceed
        this model's (the last W observed queries are what a narrower window sees).
        """
        import copy

        from .recipes import get_recipe

        recipe = self.recipe if recipe is None else get_recipe(recipe)
        budget = self.budget if budget is None else Budget.parse(budget)
        scorer, allocator = recipe.build()
        if scorer is None and not budget.is_full:
            raise ValueError(f"recipe {recipe.name!r} keeps every token; use budget=1.0 or pick a compressing recipe")
        window = scorer.observation_window if scorer else 0
        if window > self.cache.obs_window:
            raise ValueError(
                f"recipe {recipe.name!r} observes the last {window} queries but this cache kept {self.cache.obs_window}; "
                "prefill the shared context with the widest-window recipe"
            )
        shared = {id(x): x for x in (self.programs, self.spec, self.generation_config) if x is not None}
        child = copy.deepcopy(self, memo=shared)
        child.recipe, child.budget, child.scorer, child.allocator = recipe, budget, scorer, allocator
        cache = child.cache
        cache.obs_window = window
        cache.obs_q, cache.obs_pos = ops.narrow_ring(cache.obs_q, cache.obs_pos, window)  # the last `window` queries
        return child
