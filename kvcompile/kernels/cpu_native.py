"""The CPU decode step as native code: attention over fp32 and format pages (``cpu_decode.c``, called by
``FormatPages`` and ``reference.paged_attention``) and the projections of a single row (``cpu_linear.c``, called by
``passes.streamed_linear``). Built once per machine with the system's C compiler, loaded with ctypes (no Python
extension, no pickled code). Each runs only where it beats the PyTorch path on this machine (``chooser``: timed
once per shape class); where no compiler is found, where PyTorch is faster, or with
``KVCOMPILE_DECODE_BACKEND=reference``, PyTorch serves instead (the same products, summed in another order).

The build goes to ``$KVCOMPILE_CACHE/native`` (default ``~/.cache/kvcompile/native``), one small library per source
version and CPU (it is compiled for the machine it runs on)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from . import chooser
from .formats import Fp8Codec
from .integer import ChannelCodec, IntCodec
from .paging import gather_pages

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_decode.c", "cpu_linear.c"))
HEADERS = (Path(__file__).with_name("cpu_lanes.h"),)  # what both include: part of the build's key
MAX_HEAD_DIM = 512  # the row buffer in cpu_decode.c
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-lm")  # and -march=arch()
CHUNK = 64  # the most pages a thread reads into one running softmax (a chunk: the unit of work)
PAIRS = {(32, 32), (8, 8), (4, 4), (3, 3), (2, 2), (0, 0), (-4, 4), (-2, 2)}  # (key kind, value kind): pool_attend
TRIAL_HEADS, TRIAL_TOKENS = 8, 4096  # the pools a decode shape class is timed on: a layer's cache, long context
TRIAL_BYTES = 64 * 2**20  # the weights a projection class is timed on, cycled: more than the caches hold


@torch.compiler.assume_constant_result  # a traced step reads it once; the native ops check again when they run
def enabled() -> bool:
    """Built, and not switched off: ``KVCOMPILE_DECODE_BACKEND=reference`` asks for the PyTorch decode alone (where
    it is on, each op still runs natively only where that is faster: ``chooser``)."""
    return os.environ.get("KVCOMPILE_DECODE_BACKEND", "auto") != "reference" and library() is not None


def kind(codec, codes: Tensor, meta: Tensor | None) -> int | None:
    """How ``cpu_decode.c`` reads a pool's rows (its ``kind``), or None where it does not read them."""
    if codec is None:
        return 32 if codes.dtype == torch.float32 else None
    half = meta is not None and meta.dtype == torch.float16
    if type(codec) is IntCodec and half:
        return codec.bits
    if type(codec) is ChannelCodec and codec.bits in (2, 4) and half:
        return -codec.bits
    return 0 if type(codec) is Fp8Codec and meta is not None and meta.dtype == torch.float32 else None


def _plan(q: Tensor, keys: tuple, values: tuple) -> tuple[int, int, int, int] | None:
    """(key kind, value kind, key groups, value groups) where the native decode reads these pools, else None."""
    (kc, k, km), (vc, v, vm) = keys, values
    kinds = (kind(kc, k, km), kind(vc, v, vm))
    if kinds not in PAIRS or not enabled():
        return None
    D = q.shape[-1]
    groups = tuple(meta.shape[-1] // 2 if 0 < x < 32 else 1 for x, meta in zip(kinds, (km, vm)))
    fits = (q.device.type == k.device.type == v.device.type == "cpu" and D <= MAX_HEAD_DIM and D % 16 == 0
            and all((D // n) % 16 == 0 for n in groups) and q.shape[-2] <= 8 and k.shape[1] <= 256)
    return (*kinds, *groups) if fits else None


def serves(q: Tensor, keys: tuple, values: tuple) -> bool:
    """Whether the native decode can read these pools for q [B, Hkv, G, D] on the CPU (``attend`` reads them where
    it is also the faster path: ``decode_choice``). ``keys``, ``values``: (codec, codes [N, P, W], meta) of each,
    codec None for fp32 pages (meta None). Served: fp32 pages, integer rows (``IntCodec``, groups of a multiple of
    16 channels), float8 rows, per-channel keys (``ChannelCodec``) with integer values; up to 8 query rows per KV
    head and 256 rows a page."""
    return _plan(q, keys, values) is not None


def decode_choice(q: Tensor, keys: tuple, values: tuple, plan: tuple | None = None) -> chooser.Choice:
    """Whether the native decode or PyTorch's attends over pools like these (which ``serves`` reads; ``plan``: their
    ``_plan``, where known), measured on first use for their shape class: key and value kinds, head dim, query rows
    per KV head, rows a page."""
    plan, (G, D) = plan or _plan(q, keys, values), q.shape[-2:]
    native = lambda q, keys, values, table, lengths: _native_attend(  # noqa: E731
        q, [(keys, values, table, lengths, None)], [plan])
    return chooser.choose("decode", (*plan[:2], D, G, keys[1].shape[1]), native, _pytorch_attend,
                          lambda: _decode_trial(q, keys, values), build_key())


def attend(q: Tensor, keys: tuple, values: tuple, table: Tensor, lengths: Tensor, bias: Tensor | None = None,
           more: tuple = ()) -> tuple[Tensor, Tensor] | None:
    """Softmax attention of q [B, Hkv, G, D] (scaled already) over each head's rows of the pools, in place and one
    pass: the output [B, Hkv, G, D] fp32 and its log-sum-exp [B, Hkv, G] (an empty head: 0 and -inf); None where
    the native decode does not read them (``serves``) or PyTorch's is faster (``decode_choice``, of the first
    pool): the caller's path then serves. ``bias`` [N, P]: added to each row's score (log-weights). ``more``:
    further pools ``(keys, values, table, lengths)`` holding more of each head's rows (a format pool's model-dtype
    pages): one softmax over them all, their states merged natively."""
    pools = [(keys, values, table, lengths, bias), *((*pool, None) for pool in more)]
    plans = [_plan(q, k, v) for k, v, *_ in pools]
    if None in plans or not decode_choice(q, keys, values, plans[0]).native:
        return None
    return _native_attend(q, pools, plans)


def _native_attend(q: Tensor, pools: list, plans: list) -> tuple[Tensor, Tensor]:
    """``attend`` on the native decode, unchosen: ``pools`` (keys, values, table, lengths, bias) that it reads, by
    their ``plans``."""
    B, Hkv, G, D = q.shape
    q, threads = q.float().contiguous(), torch.get_num_threads()
    pools = [(pool, plan) for pool, plan in zip(pools, plans) if pool[2].shape[-1] > 0]  # a pool of no pages: no rows
    pages = [pool[2].shape[-1] for pool, _ in pools]  # NP: the pages each head's table lists
    chunks = [max(4, min(CHUNK, n * B * Hkv // (8 * threads))) for n in pages]  # >= 8 chunks a thread where possible
    counts = [-(-n // chunk) for n, chunk in zip(pages, chunks)]
    C = sum(counts)
    if not pools:  # no pages anywhere: every head empty
        return q.new_zeros(B, Hkv, G, D), q.new_full((B, Hkv, G), float("-inf"))
    scratch, out, lse = q.new_empty(B * Hkv * C * G * (D + 2)), q.new_empty(B, Hkv, G, D), q.new_empty(B, Hkv, G)
    for i, (((_, k, km), (_, v, vm), table, lengths, bias), (kk, vk, k_groups, v_groups)) in enumerate(pools):
        qsum = q.unflatten(-1, (k_groups, -1)).sum(-1).contiguous() if 0 < kk < 32 else q  # integer keys only
        empty = k.new_zeros(1)
        held = (k.contiguous(), (empty if km is None else km).contiguous(), v.contiguous(),
                (empty if vm is None else vm).contiguous(), None if bias is None else bias.float().contiguous(),
                table.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous())
        library().pool_attend(
            _ptr(q), _ptr(qsum), _ptr(held[0]), _ptr(held[1]), k.shape[-1] * k.element_size(), k_groups, kk,
            _ptr(held[2]), _ptr(held[3]), v.shape[-1] * v.element_size(), v_groups, vk,
            None if held[4] is None else _ptr(held[4]), _ptr(held[5]), _ptr(held[6]), B * Hkv, G, D, k.shape[1],
            pages[i], chunks[i], threads, C, sum(counts[:i]), int(i == len(pools) - 1), _ptr(scratch),
            _ptr(out), _ptr(lse))
    return out, lse


def decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, lengths: Tensor, scale: float,
           log_weights: Tensor | None = None) -> Tensor | None:
    """A decode step [B, Hq, 1, D] over fp32 pages, each head read in place only as far as it holds (ragged heads
    cost what they hold, with no gather); ``log_weights`` as ``reference.paged_attention`` takes them. None where
    the native decode does not read these pages or PyTorch's is faster (``attend``)."""
    B, Hq, _, D = q.shape
    qg = q.float().reshape(B, page_table.shape[1], -1, D) * scale
    bias = log_weights if log_weights is not None and log_weights.shape[0] > 0 else None
    state = attend(qg, (None, k_pages, None), (None, v_pages, None), page_table, lengths, bias)
    return None if state is None else state[0].view(B, Hq, 1, D).to(q.dtype)


def _pytorch_attend(q: Tensor, keys: tuple, values: tuple, table: Tensor, lengths: Tensor) -> Tensor:
    """What the PyTorch path computes where ``attend`` does not (``reference``: the pages gathered, scores and the
    weighted sum read from the codes, one softmax), for one pool: what the native decode is timed against."""
    (kc, k, km), (vc, v, vm) = keys, values
    K, V = gather_pages(k, table), gather_pages(v, table)
    scores = q @ K.transpose(-1, -2) if kc is None else kc.dot(q, K, gather_pages(km, table))
    held = torch.arange(K.shape[2]) < lengths[..., None]
    p = torch.softmax(scores.masked_fill(~held[:, :, None], float("-inf")), -1)
    return p @ V if vc is None else vc.mix(p, V, gather_pages(vm, table))


def _decode_trial(q: Tensor, keys: tuple, values: tuple) -> list[tuple]:
    """Pools like these (their codecs, page size, rows drawn from their pages), TRIAL_HEADS heads of TRIAL_TOKENS
    rows each on shuffled pages, and a query of their shape: one argument tuple for both paths."""
    (kc, k, km), (vc, v, vm) = keys, values
    pages = 1 + TRIAL_HEADS * -(-TRIAL_TOKENS // k.shape[1])
    drawn = torch.randint(0, k.shape[0], (pages,))
    pick = lambda t: None if t is None else t[drawn].contiguous()  # noqa: E731
    table = (1 + torch.randperm(pages - 1)).view(1, TRIAL_HEADS, -1).to(torch.int32)
    lengths = torch.full((1, TRIAL_HEADS), TRIAL_TOKENS, dtype=torch.int32)
    trial_q = torch.randn(1, TRIAL_HEADS, *q.shape[-2:]) * q.shape[-1] ** -0.5
    return [(trial_q, (kc, pick(k), pick(km)), (vc, pick(v), pick(vm)), table, lengths)]


def serves_linear(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear`` can project x [1, I] through weight [O, I]: fp32 on the CPU, I a multiple of 16 (it does
    where it is also the faster path: ``runs_linear``)."""
    return _fits_linear(x, weight) and enabled()


def _fits_linear(x: Tensor, weight: Tensor) -> bool:
    return (x.dim() == weight.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu" and x.shape[1] % 16 == 0 and weight.is_contiguous())


def linear_choice(in_features: int, out_features: int) -> chooser.Choice:
    """Whether the native projection or PyTorch's projects one row through a weight of this shape, measured on first
    use (a model has a handful of shapes)."""
    return chooser.choose("linear", (in_features, out_features), linear, _pytorch_linear,
                          lambda: _linear_trial(in_features, out_features), build_key())


def _pytorch_linear(x: Tensor, weight: Tensor) -> Tensor:
    """What ``passes.streamed_linear`` computes where ``linear`` does not: ``(weight @ x^T)^T``."""
    return torch.mm(weight, x.t()).t()


def _linear_trial(in_features: int, out_features: int) -> list[tuple]:
    """Fresh rows and weights of this shape, larger together than the caches (up to 64 copies): read from memory, as
    a decode step reads its weights."""
    copies = max(1, min(64, TRIAL_BYTES // (4 * in_features * out_features)))
    return [(torch.rand(1, in_features), torch.full((out_features, in_features), 0.5)) for _ in range(copies)]


def runs_linear(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear`` projects x through weight here: it can (``serves_linear``: the choice itself answers
    False to ``KVCOMPILE_DECODE_BACKEND=reference``, so the variable is read once a call) and it is the faster
    path."""
    return _fits_linear(x, weight) and library() is not None and linear_choice(x.shape[1], weight.shape[0]).native


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [1, I] @ weight.T -> [1, O] (``serves_linear``), the weight read once by every thread's run of rows."""
    x, (O, I) = x.contiguous(), weight.shape
    out = x.new_empty(1, O)
    library().row_linear(_ptr(x), _ptr(weight), I, O, torch.get_num_threads(), _ptr(out))
    return out


def _ptr(t: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def arch() -> str:
    """The CPU the library is compiled for, ``-march``'s value: ``native`` (this machine, the default) or the one
    ``KVCOMPILE_NATIVE_ARCH`` names, e.g. ``haswell`` (AVX2 and FMA, no AVX-512) to test or time the build an
    AVX2-only machine runs, on any x86 machine that has those."""
    name = os.environ.get("KVCOMPILE_NATIVE_ARCH", "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", name):
        raise ValueError(f"KVCOMPILE_NATIVE_ARCH={name!r} is not a -march name such as native or haswell")
    return name


def library() -> ctypes.CDLL | None:
    """The library compiled for ``arch()``, built on first use (None where it cannot be built: PyTorch serves)."""
    return _built(arch())


@functools.cache
def _built(arch: str) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    root = Path(os.environ.get("KVCOMPILE_CACHE", Path.home() / ".cache" / "kvcompile")) / "native"
    path = root / f"cpu_decode-{build_key()}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:  # built aside, then renamed: a reader never sees half
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, *FLAGS, f"-march={arch}", *map(str, SOURCES), "-o", str(built)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                warnings.warn(f"kvcompile: the native CPU decode did not build ({compiler}); PyTorch "
                              f"serves instead:\n{result.stderr[-2000:]}", stacklevel=2)
                return None
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    lib.pool_attend.restype = lib.row_linear.restype = None
    return lib


def build_key() -> str:
    """The library's version: its sources, flags and the CPU it is compiled for (a choice of backend is kept per
    build: ``chooser``)."""
    return _build_key(arch())


@functools.cache
def _build_key(arch: str) -> str:
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    flags = " ".join((*FLAGS, f"-march={arch}"))
    return hashlib.sha256(source + flags.encode() + _cpu_identity().encode()).hexdigest()[:16]


def _cpu_identity() -> str:
    """What the build depends on besides its source: the machine and its instruction set (``-march=native``)."""
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"
