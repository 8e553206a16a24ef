"""Which backend runs an op on this machine, chosen by measuring: a native kernel is used only where it beats the
PyTorch path it replaces, timed here on the op's shape class (an AVX2-only host reads a one-row projection faster
through MKL than through ``cpu_linear.c``; an AVX-512 host the other way round). Each choice is timed once per
process (a short, bounded calibration on first use) and once per machine: it is kept in
``$KVCOMPILE_CACHE/backends`` (default ``~/.cache/kvcompile/backends``), one JSON file per CPU model, instruction set,
thread count and native build, so a new CPU, flag set, thread count or kernel source measures again.
``KVCOMPILE_DECODE_BACKEND=reference`` forces the PyTorch path and ``native`` the native kernels, unmeasured."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

MARGIN = 0.05  # native must be this much faster to be chosen: within noise, PyTorch's own path stays
BUDGET_S = 0.2  # about the most one shape class's timing takes, past each block's first MIN_PASSES
MIN_PASSES, MAX_PASSES = 3, 20
ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
       "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve", "sve2")


class Choice(NamedTuple):
    """One op's backend for one shape class: native or not, the seconds per call each took (None: not timed), and
    why (``source``: measured, cached, forced, or tracing: nothing is timed inside a ``torch.compile`` trace)."""

    native: bool
    native_s: float | None
    reference_s: float | None
    source: str

    @property
    def reason(self) -> str:
        if self.source.startswith("forced"):
            return self.source
        if self.native_s is None or self.reference_s is None:
            return f"reference: {self.source}"
        speedup = self.reference_s / self.native_s
        why = f"native {speedup:.3g}x faster" if self.native else (
            f"reference: native {speedup:.3g}x, not {1 + MARGIN:.3g}x faster" if speedup >= 1
            else f"reference: native slower ({speedup:.3g}x)")
        return why if self.source == "measured" else f"{why} ({self.source})"


_memo: dict[tuple, Choice] = {}  # (op, shape class, threads, build) -> the choice: timed once per process
FORCED = {name: Choice(name == "native", None, None, f"forced by KVCOMPILE_DECODE_BACKEND={name}")
          for name in ("native", "reference")}


def choose(op: str, shape_class: tuple, native: Callable, reference: Callable, make_inputs: Callable[[], list],
           build: str) -> Choice:
    """The backend of ``op`` for ``shape_class`` (a tuple of ints and strings naming the shapes that time alike).
    ``native``, ``reference``: the two paths, called with each argument tuple of ``make_inputs()`` (a list: cycled
    through, so inputs larger together than the caches are read from memory, as a decode step reads them).
    ``build``: the native library's key (its sources, flags and CPU). Forced by ``KVCOMPILE_DECODE_BACKEND``;
    otherwise the process's choice, else this machine's cached one, else measured now and cached."""
    forced = FORCED.get(os.environ.get("KVCOMPILE_DECODE_BACKEND", "auto"))
    key = (op, shape_class, torch.get_num_threads(), build)
    choice = forced or _memo.get(key)  # a step's path: read at every call of the op
    if choice is not None:
        return choice
    ident = identity(build)
    path, name = cache_path(ident), f"{op} {' '.join(map(str, shape_class))}"
    stored = _load(path, ident).get(name)
    if stored is not None:
        choice = Choice(stored["native"], stored["native_s"], stored["reference_s"], "cached")
    elif torch.compiler.is_compiling():  # never timed inside a trace: PyTorch's path, decided again when it runs
        return Choice(False, None, None, "not measured while tracing")
    else:
        native_s, reference_s = _time(native, reference, make_inputs())
        choice = Choice(native_s * (1 + MARGIN) < reference_s, native_s, reference_s, "measured")
        _save(path, ident, name, choice)
    _memo[key] = choice
    return choice


def forget(build: str) -> None:
    """Drop this machine's choices for ``build``, on disk and in this process, so each is measured again (a choice
    timed while other work loaded the machine may be wrong: ``kvcompile doctor --remeasure``)."""
    cache_path(identity(build)).unlink(missing_ok=True)
    for key in [k for k in _memo if k[3] == build]:
        del _memo[key]


def _time(native: Callable, reference: Callable, inputs: list) -> tuple[float, float]:
    """Seconds per call of each: the best pass over ``inputs``, after one warm-up call each, in blocks ordered
    native, PyTorch, PyTorch, native (each at least MIN_PASSES, more while its quarter of BUDGET_S lasts). In
    blocks, not alternated pass by pass: what one backend leaves behind (its thread pool still spinning, the caches
    it filled) slows only the first pass of the next block, not every pass of the other backend."""
    fns = (native, reference)
    for fn in fns:
        fn(*inputs[0])
    best = [float("inf")] * 2
    for i in (0, 1, 1, 0):
        start = time.perf_counter()
        for n in range(MAX_PASSES):
            t0 = time.perf_counter()
            for args in inputs:
                fns[i](*args)
            best[i] = min(best[i], (time.perf_counter() - t0) / len(inputs))
            if n + 1 >= MIN_PASSES and time.perf_counter() - start > BUDGET_S / 4:
                break
    return best[0], best[1]


@functools.cache
def cpu() -> tuple[str, tuple[str, ...]]:
    """This CPU's model name and instruction-set flags (``/proc/cpuinfo``; the platform's words elsewhere)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, tuple((fields.get("flags") or fields.get("Features") or "").split())


def identity(build: str) -> dict:
    """What a choice holds for: the CPU, its flags, the torch threads the kernels run on and the native build."""
    model, flags = cpu()
    return {"cpu": model, "flags": " ".join(flags), "threads": torch.get_num_threads(), "build": build}


def cache_path(ident: dict) -> Path:
    root = Path(os.environ.get("KVCOMPILE_CACHE", Path.home() / ".cache" / "kvcompile")) / "backends"
    return root / f"{hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]}.json"


def _load(path: Path, ident: dict) -> dict:
    """The choices stored for ``ident``; none (with a warning) where the file cannot be read or is not one of ours."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data["identity"] != ident:
            raise ValueError("written for another machine or build")
        choices = data["choices"]
        for c in choices.values():
            if not (isinstance(c["native"], bool) and all(isinstance(c[t], float) for t in ("native_s",
                                                                                            "reference_s"))):
                raise ValueError(f"not a choice: {c}")
        return choices
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"kvcompile: ignoring the backend choices in {path} ({type(e).__name__}: {e}); measuring "
                      "again", stacklevel=3)
        return {}


def _save(path: Path, ident: dict, name: str, choice: Choice) -> None:
    """Add one choice to the file, written aside and renamed (a reader never sees half); a file that cannot be
    written leaves the choice to this process alone, with a warning."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unreadable file has been warned about already
            choices = _load(path, ident)
        choices[name] = {"native": choice.native, "native_s": choice.native_s, "reference_s": choice.reference_s}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump({"identity": ident, "choices": choices}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"kvcompile: could not keep the backend choice in {path} ({e})", stacklevel=3)


def read_bandwidth(mib: int = 256, repeats: int = 3) -> float:
    """This machine's read bandwidth in GB/s: the best of ``repeats`` sums over an fp32 tensor of ``mib`` MiB (far
    larger than any cache), the speed a decode step's weights and pages are read at, at best."""
    src = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9
