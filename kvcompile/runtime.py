"""``CompressedModel``: prefill, decode and generate over the paged cache, compressing per the recipe.

The path of one token: ``generate`` -> ``prefill`` / ``decode`` -> ``_step`` (reserve pages, compute positions and
pool rows) -> the rewritten program (``passes.rewrite``), whose kvcompile ops write K/V into the cache and attend
-> after a prefill, ``compress.compress`` keeps the budget's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, fx, nn

from . import passes
from .budget import Budget
from .cache import PagedKVCache
from .compress import compress as compress_cache
from .recipes import Recipe
from .spec import ModelSpec

_DECODE_RESERVE = 64  # tokens of room reserved at a time while decoding (allocation stays off the step)


@dataclass
class Programs:
    """The two programs a ``CompressedModel`` runs, and what they were made from.

    ``prefill`` / ``prefill_last`` / ``decode``: ``(input_ids, position_ids, q_pos, slots, *cache tensors) ->
    logits`` (eager FX graphs, their compiled versions, or loaded AOTInductor packages); ``prefill_last`` returns
    only the last position's logits (what generation needs); ``scales``: the softmax scale per layer;
    ``captured``: the captured model graph, kept so a new recipe or budget needs no new capture.
    """

    prefill: Callable
    prefill_last: Callable
    decode: Callable
    scales: list[float]
    captured: fx.GraphModule | None = None

    NAMES = ("prefill", "prefill_last", "decode")

    @classmethod
    def rewrite(cls, captured: fx.GraphModule, spec: ModelSpec, compile=False) -> "Programs":
        prefill = passes.rewrite(captured, spec, decode=False)
        prefill_last = passes.rewrite(captured, spec, decode=False, last_logits=True)
        decode = passes.rewrite(captured, spec, decode=True)
        scales = [0.0] * spec.num_layers
        for node in prefill.graph.nodes:
            if "kvc.layer" in node.meta:
                scales[node.meta["kvc.layer"]] = node.kwargs["scale"]
        if compile:
            backend = "inductor" if compile is True else compile
            cuda = next(captured.parameters()).device.type == "cuda"
            prefill, prefill_last = (torch.compile(p, backend=backend, fullgraph=True, dynamic=True)
                                     for p in (prefill, prefill_last))
            # static shapes: lengths change values, not shapes, so decode compiles once; CUDA graphs on CUDA
            # (mode="reduce-overhead", not yet run on a GPU)
            mode = "reduce-overhead" if cuda and backend == "inductor" else None
            decode = torch.compile(decode, backend=backend, fullgraph=True, dynamic=False, mode=mode)
        return cls(prefill, prefill_last, decode, scales, captured)


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
        window = self.scorer.observation_window if self.scorer else 0
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
        self._max_seen = 0  # host copy of seen.max(), so decode checks lengths without a device sync

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
            peak_bytes_held=max(self.peak_bytes_held, stats["bytes_held"]),  # decode only grows the cache
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
        W = self.cache.obs_window
        if W and program is not self.programs.decode:  # the prefill ops remember their last W queries
            self.cache.obs_pos = torch.cat([self.cache.obs_pos, q_pos], 1)[:, -W:]
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
                self._compress()
        self._room = 0
        self._max_seen = int(self.seen.max())
        return torch.cat(outs, 1) if logits == "all" else outs[-1]

    def _compress(self) -> None:
        if self.budget.is_full or self.scorer is None:
            return
        budget = self._budget_bytes()
        if bool((self.cache.bytes_held() > budget).any()):
            compress_cache(self.cache, self.scorer, self.allocator, budget, self.programs.scales, self.spec.windows)

    def decode(self, input_ids: Tensor) -> Tensor:
        """Append one token per sequence ([B, 1]) and return its logits [B, 1, V]."""
        if self.seen is None:
            raise RuntimeError("decode needs a prefilled cache: call prefill first")
        real = self._check_tokens(input_ids, None)
        if input_ids.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, got input_ids of shape {tuple(input_ids.shape)}")
        if self._room == 0:
            self.cache.reserve(_DECODE_RESERVE)
            self._room = _DECODE_RESERVE
        self._room -= 1
        self._max_seen += 1
        return self._step(self.programs.decode, input_ids, real)

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
