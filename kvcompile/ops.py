"""The custom ops the rewritten graph calls, registered with ``torch.library``.

Each attention op replaces one scaled-dot-product-attention node and does, for its layer: write the new K/V
into the pages the cache reserved for them, remember the last queries for window scorers (prefill only), and
attend from the new queries over every token the layer's KV heads hold (causal by original position, optionally
sliding-window).
``prefill_attention`` and ``decode_attention`` share that contract; they differ in the kernel a backend picks
(decode is one query per row, the case the paged decode kernel is built for). ``compact`` moves the kept tokens
of every head to the front of its own pages.

Shapes: q [B, Hq, T, D]; k, v [B, Hkv, T, D]; q_pos [B, T] original positions, -1 for padding;
slots [L, B, Hkv, T] pool rows for the new tokens (``PagedKVCache.slots_for``). Cache tensors as in
``kvcompile.cache``. Every op has a pure-PyTorch implementation (CPU, and the oracle in tests); on CUDA the
decode attention and the compaction run the Triton kernels of ``kvcompile.kernels``.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from .kernels import reference

_MUTATED = ("k_pages", "v_pages", "page_pos", "obs_q")


def _observe(obs_q: Tensor, layer: int, q: Tensor) -> None:
    """Keep the last W queries of this layer (rolling across calls, so chunked prefill sees a full window)."""
    W = obs_q.shape[3]
    if W == 0:
        return
    recent = torch.cat([obs_q[layer], q.to(obs_q.dtype)], dim=2)[:, :, -W:]
    obs_q[layer].copy_(recent)


def _on_gpu(t: Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the PyTorch reference."""
    return t.is_cuda and importlib.util.find_spec("triton") is not None


def _attend(q, k, v, q_pos, slots, k_pages, v_pages, page_pos, page_table, lengths, obs_q, layer, scale, window, decode):
    reference.write_tokens(k_pages, v_pages, page_pos, k, v, q_pos, slots[layer])
    if not decode:  # window scorers read prefill queries; decode steps stay free of that copy
        _observe(obs_q, layer, q)
    attend = reference.paged_attention
    if decode and _on_gpu(q):
        from .kernels.triton_decode import paged_decode as attend
    return attend(q, q_pos, k_pages, v_pages, page_pos, page_table[layer], lengths[layer], scale, window).contiguous()


def _attention_op(name: str, doc: str, decode: bool):
    """Register one attention op; prefill and decode share the contract (and the CPU path), not the kernel."""

    @torch.library.custom_op(f"kvcompile::{name}", mutates_args=_MUTATED)
    def op(
        q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, slots: Tensor,
        k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor, lengths: Tensor, obs_q: Tensor,
        layer: int, scale: float, window: int,
    ) -> Tensor:
        return _attend(
            q, k, v, q_pos, slots, k_pages, v_pages, page_pos, page_table, lengths, obs_q, layer, scale, window, decode
        )

    @op.register_fake
    def _fake(q, *args, **kwargs):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    op.__doc__ = doc
    return op


prefill_attention = _attention_op(
    "prefill_attention", "Append T new tokens per row and attend causally over everything the layer holds -> [B, Hq, T, D].",
    decode=False,
)
decode_attention = _attention_op(
    "decode_attention", "Append one token per row and attend over each KV head's ragged pages -> [B, Hq, 1, D].",
    decode=True,
)


@torch.library.custom_op("kvcompile::compact", mutates_args=("k_pages", "v_pages", "page_pos"))
def compact(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor, keep_idx: Tensor, keep_count: Tensor
) -> None:
    """Move each head's kept tokens (ascending logical indices) to the front of its own pages, in place."""
    move = reference.compact
    if _on_gpu(k_pages):
        from .kernels.triton_compact import compact as move
    move(k_pages, v_pages, page_pos, page_table, keep_idx, keep_count)


@compact.register_fake
def _compact_fake(k_pages, v_pages, page_pos, page_table, keep_idx, keep_count):
    return None
