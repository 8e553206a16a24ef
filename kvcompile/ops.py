"""The custom ops the rewritten graph calls, registered with ``torch.library``.

Each attention op replaces one scaled-dot-product-attention node and does, for its layer: write the new K/V
into the pages the cache reserved for them, remember the last W queries in the ring ``obs_q`` (what window
scorers and decode-time policies read; see ``ring_slots``), and attend from the new queries over every token the
layer's KV heads hold (causal by original position, optionally sliding-window).
``prefill_attention`` and ``decode_attention`` share that contract; they differ in the kernel a backend picks
(decode is one query per row, the case the paged decode kernel is built for). ``decode_attention_packed`` may
assume a packed cache (``PagedKVCache.packed``; the runtime checks before it runs a program that calls it), so
the reference reads each layer's pages as one slice of the pool instead of gathering them. ``compact`` moves the kept tokens
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


def ring_slots(q_pos: Tensor, window: int) -> Tensor:
    """Ring slot [B, T] of each new query: its position mod W, or W (nowhere) for padding and for queries that
    W newer ones in the same call push out. Slot s then always holds the newest query at a position = s (mod W),
    so the ring holds the last W queries of the row across calls (chunked prefill, decode) without shifting."""
    newest = q_pos.amax(-1, keepdim=True)
    kept = (q_pos >= 0) & (q_pos > newest - window)
    return torch.where(kept, q_pos % window, window)


def ring_write(ring: Tensor, slot: Tensor, new: Tensor, dim: int) -> Tensor:
    """A copy of ``ring`` (W slots along ``dim``) with ``new`` written at ``slot`` (shaped like ``new``; W: dropped)."""
    pad = list(ring.shape)
    pad[dim] = 1
    out = torch.cat([ring, ring.new_zeros(pad)], dim).scatter_(dim, slot, new.to(ring.dtype))
    return out.narrow(dim, 0, ring.shape[dim])


def narrow_ring(obs_q: Tensor, obs_pos: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """The ring of each row's ``window`` newest observed queries, laid out for that width: obs_q [L, B, Hq, w, D],
    obs_pos [B, w] (what a cache that kept only ``window`` queries would hold)."""
    L, B, Hq, W, D = obs_q.shape
    if window == 0:
        return obs_q[:, :, :, :0].contiguous(), obs_pos[:, :0].contiguous()
    slot = ring_slots(obs_pos, window)  # [B, W]
    q = obs_q.new_zeros(L, B, Hq, window, D)
    q = ring_write(q, slot[None, :, None, :, None].expand(L, B, Hq, W, D), obs_q, dim=3)
    return q, ring_write(obs_pos.new_full((B, window), -1), slot, obs_pos, dim=1)


def _observe(obs_q: Tensor, layer: int, q: Tensor, q_pos: Tensor, decode: bool) -> None:
    """Write this layer's new queries into its ring of the last W queries (``ring_slots``)."""
    B, Hq, T, D = q.shape
    W = obs_q.shape[3]
    if W == 0:
        return
    if decode:  # one real query per row: write its slot in place, O(B * Hq * D) per step
        obs_q[layer].scatter_(2, (q_pos % W)[:, None, :, None].expand(B, Hq, 1, D), q.to(obs_q.dtype))
        return
    slot = ring_slots(q_pos, W)[:, None, :, None].expand(B, Hq, T, D)
    obs_q[layer].copy_(ring_write(obs_q[layer], slot, q, dim=2))


def _on_gpu(t: Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the PyTorch reference."""
    return t.is_cuda and importlib.util.find_spec("triton") is not None


def _attend(
    q, k, v, q_pos, slots, k_pages, v_pages, page_pos, page_table, lengths, obs_q, layer, scale, window, packed, decode
):
    reference.write_tokens(k_pages, v_pages, page_pos, k, v, q_pos, slots[layer])
    _observe(obs_q, layer, q, q_pos, decode)
    args = (q, q_pos, k_pages, v_pages, page_pos, page_table[layer], lengths[layer], scale, window)
    if decode and _on_gpu(q):  # the kernel reads each head's pages where they are, packed or not
        from .kernels.triton_decode import paged_decode

        return paged_decode(*args)
    first_page = 1 + layer * page_table[layer].numel() if packed else None  # PagedKVCache.packed's layout
    return reference.paged_attention(*args, first_page=first_page).contiguous()


def _attention_op(name: str, doc: str, decode: bool, packed: bool = False):
    """Register one attention op; prefill and decode share the contract (and the CPU path), not the kernel.

    Decode is a ``triton_op``: ``torch.compile`` traces into it, so Inductor sees the Triton kernel itself on CUDA
    (and the reference ops on CPU) instead of an opaque call, and the step can be captured whole in a CUDA graph.
    Prefill stays an opaque ``custom_op``: its reference picks a path from tensor values (a plain causal first
    prefill, shared masks), which tracing would turn into guards.
    """
    register = torch.library.triton_op if decode else torch.library.custom_op

    @register(f"kvcompile::{name}", mutates_args=_MUTATED)
    def op(
        q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, slots: Tensor,
        k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor, lengths: Tensor, obs_q: Tensor,
        layer: int, scale: float, window: int,
    ) -> Tensor:
        return _attend(
            q, k, v, q_pos, slots, k_pages, v_pages, page_pos, page_table, lengths, obs_q, layer, scale, window,
            packed, decode,
        )

    if not decode:  # a triton_op's own body is its fake kernel

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
decode_attention_packed = _attention_op(
    "decode_attention_packed",
    "``decode_attention`` over a packed cache (``PagedKVCache.packed``): each layer's pages read in place as one slice.",
    decode=True, packed=True,
)


@torch.library.triton_op("kvcompile::compact", mutates_args=("k_pages", "v_pages", "page_pos"))
def compact(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor, keep_idx: Tensor, keep_count: Tensor
) -> None:
    """Move each head's kept tokens (ascending logical indices) to the front of its own pages, in place."""
    move = reference.compact
    if _on_gpu(k_pages):
        from .kernels.triton_compact import compact as move
    move(k_pages, v_pages, page_pos, page_table, keep_idx, keep_count)
