"""The custom ops the rewritten graph calls, registered with ``torch.library``.

Each attention op replaces one scaled-dot-product-attention node and does, for its layer: write the new K/V
into the pages the cache reserved for them (padding writes zeros to the scratch page), write the new queries into
the observation ring at the slots the cache chose (``cache.QueryRing``), and attend from the new queries over
every token the layer's KV heads hold (causal by original position, optionally sliding-window).
``prefill_attention`` and ``decode_attention`` share that contract; they differ in the kernel a backend picks
(decode is one query per row, the case the paged decode kernel is built for). ``decode_attention_packed`` may
assume a packed cache (``PagedKVCache.packed``; the runtime checks before it runs a program that calls it), so
the reference reads each layer's pages as one slice of the pool instead of gathering them. ``compact`` moves the
kept tokens of every head to the front of its own pages.

Shapes: q [B, Hq, T, D]; k, v [B, Hkv, T, D]; q_pos [B, T] original positions, -1 for padding;
slots [L, B, Hkv, T] pool rows for the new tokens and ring_slots [B, T] ring slots (``PagedKVCache.append``);
page_lw the entries' log-weights, read only ([0, P] for a cache without weighted entries; a new token's row is
already 0: ``cache.weights``);
obs_q the ring's queries [L, B, Hq, C, D] and obs_lse the log-sum-exp of the attention that read each [L, B, Hq, C]
(written where the op computes it: new tokens after every held entry on the CPU; ``cache.QueryRing``); fmt the
format pool, read only, as one list of tensors named and ordered by ``signature.FORMAT_POOL`` (``cache.formatted``;
its format is read from its tensors, so one program serves every format). Cache tensors as in ``kvcompile.cache``.
Every op has a pure-PyTorch implementation (CPU, and the oracle in tests); on CUDA the decode attention and the
compaction run the Triton kernels of ``kvcompile.kernels``; on the CPU a traced decode step reaches the native
kernels (``kernels.cpu_native``) through the opaque ops ``native_decode``, ``format_attention`` and ``native_linear``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os

import torch
from torch import Tensor

from .kernels import cpu_native, reference

_MUTATED = ("k_pages", "v_pages", "page_pos", "obs_q", "obs_lse")
EAGER_BODIES: dict = {}  # an attention op's overload -> the Python function it runs: what eager programs call
# (``passes.CallBodiesDirectly``)
DECODE_BACKENDS = ("auto", "reference", "flex", "native")


def decode_backend() -> str:
    """The decode attention backend, from ``KVCOMPILE_DECODE_BACKEND``: ``auto`` (default: the Triton kernel on
    CUDA; on the CPU the native kernels, ``kernels.cpu_native``, where they read the pages and are the faster path
    on this machine, ``kernels.chooser``; the PyTorch reference elsewhere), ``native`` (as ``auto``, with the native
    kernels wherever they read the pages, unmeasured), ``reference`` (the PyTorch reference alone), or ``flex``
    (``kernels.flex``: flex_attention compiled by Inductor, its C++ template on CPU; eager programs over model-dtype
    pages only). Read at every decode step of an eager program, and when a compiled one is traced."""
    name = os.environ.get("KVCOMPILE_DECODE_BACKEND", "auto")
    if name not in DECODE_BACKENDS:
        raise ValueError(f"KVCOMPILE_DECODE_BACKEND={name!r}: pick one of {', '.join(DECODE_BACKENDS)}")
    return name


@functools.cache
def _compiled_flex():
    """flex_attention through Inductor, compiled once per process: eager flex_attention is a reference that
    materialises every score. Shapes are automatic-dynamic (a second pool size recompiles once, with sizes as
    symbols): compiled per shape, a process meeting more than dynamo's recompile limit (8) of pool sizes fell back
    to eager flex_attention, 10-20x slower (measured in the issue-22 grid, where it did)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_decode(args: tuple, page_lw: Tensor) -> Tensor:
    from .kernels.flex import flex_paged_decode

    return flex_paged_decode(*args, attend=_compiled_flex(), log_weights=page_lw)


def check_decode_backend(page_format: str | None, compiled, backend: str | None = None) -> None:
    """Refuse, at ``apply``, a decode backend (``backend``, else ``decode_backend()``) that cannot serve these
    programs."""
    if (backend or decode_backend()) != "flex":
        return
    if page_format is not None:
        raise ValueError(f"KVCOMPILE_DECODE_BACKEND=flex reads model-dtype pages; this recipe stores {page_format!r} "
                         "pages (use the auto or reference backend)")
    if compiled:
        raise ValueError("KVCOMPILE_DECODE_BACKEND=flex runs in eager programs (apply(..., compile=False)): its block "
                         "mask is built from the page table's values at every step")


def _refuse_flex(stored) -> None:
    """The same limits at a decode step (the variable may have changed since ``apply``), before anything is written."""
    check_decode_backend(None if stored.empty else "a page format's", torch.compiler.is_compiling(), "flex")


def _observe(obs_q: Tensor, layer: int, q: Tensor, ring_slots: Tensor, decode: bool) -> None:
    """Write this layer's new queries into the ring slots the cache chose (``QueryRing.slots``; C = nowhere).

    Written with ``index_put_`` on the ring itself, not through a view of it: under ``torch.compile`` a write
    through a view makes Inductor clone the whole tensor every step."""
    L, B, Hq, C, D = obs_q.shape
    if C == 0:
        return
    heads = torch.arange(Hq, device=q.device)
    if decode:  # one real query per row, always kept: O(B * Hq * D) per step
        b = torch.arange(B, device=q.device)[:, None].expand(B, Hq)
        at = (torch.full_like(b, layer), b, heads.expand(B, Hq), ring_slots.expand(B, Hq))
        obs_q.index_put_(at, q[:, :, 0].to(obs_q.dtype))
        return
    _write_ring(obs_q, layer, q, ring_slots)


def _write_ring(ring: Tensor, layer: int, values: Tensor, ring_slots: Tensor) -> None:
    """Write a prefill's per-query ``values`` [B, Hq, T, ...] (its queries, their log-sum-exps) into the ring tensor
    ``ring`` [L, B, Hq, C, ...] at the slots the cache chose (C = nowhere)."""
    Hq, C = ring.shape[2], ring.shape[3]
    if C == 0:
        return
    row, t = (ring_slots < C).nonzero(as_tuple=True)  # prefill is an opaque op: data-dependent shapes are fine
    b, h = row[:, None].expand(-1, Hq), torch.arange(Hq, device=values.device).expand(row.numel(), Hq)
    at = (torch.full_like(b, layer), b, h, ring_slots[row, t][:, None].expand(-1, Hq))
    ring.index_put_(at, values[row, :, t].to(ring.dtype))


def _on_gpu(t: Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the PyTorch reference."""
    return t.is_cuda and importlib.util.find_spec("triton") is not None


def _attend(
    q, k, v, q_pos, slots, ring_slots, k_pages, v_pages, page_pos, page_lw, page_table, lengths, obs_q, obs_lse, fmt,
    layer, scale, window, packed, decode,
):
    stored = reference.FormatPages.of_layer(fmt, layer)
    backend = decode_backend() if decode else "auto"
    if backend == "flex":
        _refuse_flex(stored)
    padded = decode or bool((q_pos < 0).any())  # prefill is opaque, so it may read values; decode is traced
    reference.write_tokens(k_pages, v_pages, page_pos, k, v, q_pos, slots[layer], padded)
    _observe(obs_q, layer, q, ring_slots, decode)
    args = (q, q_pos, k_pages, v_pages, page_pos, page_table[layer], lengths[layer], scale, window)
    if not decode:
        if _first_chunk(q_pos, lengths[layer], stored, window):  # attend over what was stored: the pool's dtype
            k, v = (x.to(k_pages.dtype).to(q.dtype) for x in (k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        else:
            merged = _after_held(q, k, v, q_pos, k_pages, v_pages, page_pos, page_table[layer], lengths[layer],
                                 page_lw, stored, scale, window)
            if merged is None:
                out = reference.paged_attention(*args, stored=stored, log_weights=page_lw)
            else:
                out, lse = merged
                _write_ring(obs_lse, layer, lse, ring_slots)
        return out.contiguous()
    if backend == "flex":
        return _flex_decode(args, page_lw)
    if backend in ("auto", "native") and _on_gpu(q) and (stored.empty or stored.triton_reads(q.shape[-1])):
        # the kernel reads each head's pages where they are, packed or not, in any format it decodes
        from .kernels.triton_decode import paged_decode

        return paged_decode(*args, stored=stored, log_weights=page_lw)
    first_page = 1 + layer * page_table[layer].numel() if packed else None  # PagedKVCache.packed's layout
    if not stored.empty:  # no weighted entry lives beside a format pool (refused at apply)
        if not torch.compiler.is_compiling():  # eager: the op's body, without the dispatcher's cost a layer
            return reference.paged_attention(*args, first_page=first_page, stored=stored).contiguous()
        return format_attention(*args, list(stored), -1 if first_page is None else first_page)
    if backend in ("auto", "native") and window == 0 and torch.compiler.is_compiling() and cpu_native.serves(
            q.reshape(q.shape[0], page_table.shape[2], -1, q.shape[-1]), (None, k_pages, None), (None, v_pages, None)):
        return native_decode(*args[:7], page_lw, scale)
    return reference.paged_attention(*args, first_page=first_page, log_weights=page_lw).contiguous()


def _first_chunk(q_pos, lengths, stored, window) -> bool:
    """Whether every head holds exactly the new tokens, at consecutive positions (so no padding), with no entry in a
    format pool and no window: attention is then plain causal over the new keys and values, one SDPA call as the
    uncompressed model makes, without reading back what was just written (a new entry's log-weight is 0, so weights
    change nothing)."""
    T = q_pos.shape[1]
    return window == 0 and not stored.holds_entries() and bool((lengths == T).all()) and _consecutive(q_pos)


def _consecutive(q_pos: Tensor) -> bool:
    """Whether each row's T new tokens stand at consecutive positions (so none is padding after its first)."""
    return bool((q_pos == q_pos[:, :1] + torch.arange(q_pos.shape[1], device=q_pos.device)).all())


def _after_held(q, k, v, q_pos, k_pages, v_pages, page_pos, page_table, lengths, page_lw, stored, scale, window):
    """``reference.after_held`` (the output and its log-sum-exp) where it applies: on the CPU, every row's T new
    tokens real and at consecutive positions (so each head holds them as its last T entries), no window, no weighted
    entry and no entry in a format pool; None elsewhere."""
    T = q_pos.shape[1]
    if (q.device.type != "cpu" or window > 0 or page_lw.shape[0] > 0 or stored.holds_entries()
            or not bool((lengths >= T).all()) or not _consecutive(q_pos) or not bool((q_pos[:, 0] >= 0).all())):
        return None
    before = lengths - T
    pages = -(-int(before.max()) // k_pages.shape[1])  # as far as the longest head held
    held = reference.gather_dense(k_pages, v_pages, page_pos, page_table[..., :pages], before)
    k, v = (x.to(k_pages.dtype) for x in (k, v))  # attend over what was stored: the pool's dtype
    return reference.after_held(q, q_pos, k, v, held, scale)


@torch.library.custom_op("kvcompile::format_attention", mutates_args=())
def format_attention(
    q: Tensor, q_pos: Tensor, k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor,
    lengths: Tensor, scale: float, window: int, stored: list[Tensor], first_page: int,
) -> Tensor:
    """A decode step's attention over one layer's two pools on the PyTorch path (``reference.paged_attention`` with
    ``stored``, the layer's ``FormatPages`` as a list; ``first_page`` -1: not packed). Opaque to ``torch.compile``:
    traced, the pool would be one tile (a loop over its width would specialise on it) and every layer's decoding code
    would be compiled (SmolLM2's first compile ran past 5 minutes); as one call it runs the eager two-pass tiles, which
    beat Inductor's code for the fused reduction here (``docs/results.md``, "Page formats")."""
    return reference.paged_attention(q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, scale, window,
                                     first_page=None if first_page < 0 else first_page,
                                     stored=reference.FormatPages._make(stored)).contiguous()


@format_attention.register_fake
def _(q, *args):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvcompile::native_decode", mutates_args=())
def native_decode(q: Tensor, q_pos: Tensor, k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor,
                  lengths: Tensor, page_lw: Tensor, scale: float) -> Tensor:
    """A traced CPU decode step over fp32 pages without a window, as one call to the native decode
    (``kernels.cpu_native``: each head read in place as far as it holds), where Inductor would otherwise compile
    the reference's gather over the page table's whole width. Opaque, as ``format_attention``; the PyTorch decode
    serves where the native one is switched off or slower when the step runs (``cpu_native.attend``)."""
    return reference.paged_attention(q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, scale,
                                     log_weights=page_lw).contiguous()


@native_decode.register_fake
def _(q, *args):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvcompile::native_linear", mutates_args=())
def native_linear(x: Tensor, weight: Tensor) -> Tensor:
    """A traced one-row projection x [1, I] @ weight.T as one call to the native projection
    (``passes.streamed_linear``); PyTorch's where the native one is switched off or slower when the step runs."""
    return cpu_native.linear(x, weight) if cpu_native.runs_linear(x, weight) else x @ weight.t()


@native_linear.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


@contextlib.contextmanager
def _quiet_without_triton():
    """``triton_op`` looks for Triton kernels in the op's body and logs a warning for every op when Triton is not
    installed (the default install); nothing is missing then, since the CPU never runs a Triton kernel."""
    log = logging.getLogger("torch._library.triton")
    level = log.level
    if importlib.util.find_spec("triton") is None:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _attention_op(name: str, doc: str, decode: bool, packed: bool = False):
    """Register one attention op; prefill and decode share the contract (and the CPU path), not the kernel.

    Decode is a ``triton_op``: ``torch.compile`` traces into it, so Inductor sees the Triton kernel itself on CUDA
    (and the reference ops on CPU) instead of an opaque call, and the step can be captured whole in a CUDA graph.
    Prefill stays an opaque ``custom_op``: its reference picks a path from tensor values (a plain causal first
    prefill, shared masks), which tracing would turn into guards.
    """
    register = torch.library.triton_op if decode else torch.library.custom_op

    def body(
        q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, slots: Tensor, ring_slots: Tensor,
        k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_lw: Tensor, page_table: Tensor, lengths: Tensor,
        obs_q: Tensor, obs_lse: Tensor, fmt: list[Tensor], layer: int, scale: float, window: int,
    ) -> Tensor:
        return _attend(
            q, k, v, q_pos, slots, ring_slots, k_pages, v_pages, page_pos, page_lw, page_table, lengths, obs_q, obs_lse,
            fmt, layer, scale, window, packed, decode,
        )

    with _quiet_without_triton():
        op = register(f"kvcompile::{name}", mutates_args=_MUTATED)(body)
    EAGER_BODIES[getattr(torch.ops.kvcompile, name).default] = body
    if not decode:  # a triton_op's own body is its fake kernel

        @op.register_fake
        def _fake(q, *args, **kwargs):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

    op.__doc__ = doc
    return op


prefill_attention = _attention_op(
    "prefill_attention", "Append T new tokens per row and attend causally over all the layer holds -> [B, Hq, T, D].",
    decode=False,
)
decode_attention = _attention_op(
    "decode_attention", "Append one token per row and attend over each KV head's ragged pages -> [B, Hq, 1, D].",
    decode=True,
)
decode_attention_packed = _attention_op(
    "decode_attention_packed",
    "``decode_attention`` over a packed cache (``PagedKVCache.packed``): each layer's pages read in place, one slice.",
    decode=True, packed=True,
)


def _compact(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_lw: Tensor, page_table: Tensor, keep_idx: Tensor,
    keep_count: Tensor,
) -> None:
    """Move each head's kept tokens (ascending logical indices) to the front of its own pages, in place (with their
    log-weights, where ``page_lw`` is not empty)."""
    move = reference.compact
    if _on_gpu(k_pages):
        from .kernels.triton_compact import compact as move
    move(k_pages, v_pages, page_pos, page_lw, page_table, keep_idx, keep_count)


with _quiet_without_triton():
    compact = torch.library.triton_op("kvcompile::compact", mutates_args=("k_pages", "v_pages", "page_pos",
                                                                          "page_lw"))(_compact)
