"""Where the bench scripts write their results, and what each result records so that its figure can be replayed.

A number is only worth keeping if someone can make it again and knows what it was measured on. So every script of
bench/ writes through ``Results``, which puts its files under ``bench/results/<script>/`` (unless ``--out`` says
elsewhere) and writes beside them ``<stem>.record.json``: the command line, the git commit and whether the tree had
uncommitted changes, the versions of Python and of the packages results depend on, the CPU model, its instruction-set
flags, the threads, the read bandwidth measured on this machine (once per process, ``bandwidth``), the GPU where
CUDA was used, the time, and the files it describes. A Markdown result also opens with one paragraph naming the
command, commit and machine, so every table says where it was measured.

    from record import Results

    out = Results("decode", args.out)    # stem bench/results/decode/decode, or --out
    out.json({"rows": rows})             # decode.json
    out.markdown(table(rows))            # decode.md, the machine named at its top
    out.figure(plot(rows))               # decode.png
    out.adopt(sweep.write(result, out.stem))   # files another writer made at the stem

A command that is not a bench script (``kvcompile eval``, ``kvcompile analyze ...``) gets the same record when it is
run through this file: ``python bench/record.py -- kvcompile eval ... --out bench/results/kvcompile-eval/x``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PACKAGES = ("torch", "transformers", "kvcompile", "numpy", "triton", "kvpress", "optimum-quanto")
# the instruction sets the native kernels, torch's CPU dispatch and the quantized formats' speed depend on
FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",  # x86 (/proc/cpuinfo "flags")
         "asimd", "asimddp", "asimdhp", "fphp", "i8mm", "bf16", "sve", "sve2")  # Arm ("Features"; asimd is NEON)
ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES")  # and every KVCOMPILE_*


def default_stem(script: str, name: str | None = None) -> Path:
    """The default path stem of a result of ``script``: ``bench/results/<script>/<name or script>``."""
    return RESULTS / script / (name or script)


def bandwidth(mib: int = 1024, repeats: int = 7) -> dict:
    """GB/s of this machine: ``read`` (the best of ``repeats`` sums over an fp32 tensor of ``mib`` MiB, far larger
    than any cache) and ``copy`` (read + write bytes of a copy). A decode step reads its weights and K/V once, so
    read bandwidth is the floor every speed table is measured against (``bench/floor.py``)."""
    import torch

    src = torch.rand(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = {"read": float("inf"), "copy": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best["read"] = min(best["read"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best["copy"] = min(best["copy"], time.perf_counter() - t0)
    n = src.numel() * 4
    return {"read": n / best["read"] / 1e9, "copy": 2 * n / best["copy"] / 1e9}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def machine() -> dict:
    """The CPU this process runs on: model, the instruction-set flags of ``FLAGS`` it has, torch's CPU dispatch
    level, cores, and its bandwidth, measured on the first call only (it takes a second or two and two
    GiB-sized tensors; every later result of the process reuses it)."""
    info = _cpuinfo()
    present = set((info.get("flags") or info.get("Features") or "").split())
    out = {"cpu": info.get("model name") or info.get("Hardware") or platform.processor() or platform.machine(),
           "flags": [f for f in FLAGS if f in present], "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        pass
    out["bandwidth_gbs"] = bandwidth()
    return out


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def repository() -> dict:
    """The commit this process's code came from and whether tracked files differed from it, read once: the code a
    run executes is the code it started with, whatever is committed while it runs. None where git cannot tell."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def command(argv: list[str] | None = None) -> str:
    """``argv`` (this process's by default) as a shell line to run again from the repository root: the settings
    of ``ENV`` and ``KVCOMPILE_*`` in front, a script named relative to the root, behind ``python``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    if script.suffix == ".py":
        if script.resolve().is_relative_to(ROOT):
            script = script.resolve().relative_to(ROOT)
        argv = ["python", str(script), *argv[1:]]
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(environment().items())]
    return " ".join([*env, shlex.join(argv)])


def environment() -> dict[str, str]:
    """The environment variables that change what a run measures (threads, the decode backend, offline hub)."""
    return {k: v for k, v in os.environ.items() if k in ENV or k.startswith("KVCOMPILE_")}


def _gpu() -> str | None:
    """The GPU's name where this process used CUDA (initialized it), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_device_name()


def _threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def header(record: dict, record_file: str) -> str:
    """One Markdown paragraph naming what a result was made by and on: the command, the commit, the CPU with its
    flags, threads and read bandwidth, the GPU, the main versions; the record file holds the rest."""
    m, v = record["machine"], record["versions"]
    commit = record["commit"][:10] if record["commit"] else "an unknown commit"
    commit += " (uncommitted changes)" if record["dirty"] else ""
    flags = ", ".join(m["flags"]) or "no flags read"
    gpu = f"; GPU {record['gpu']}" if record["gpu"] else ""
    versions = ", ".join(f"{p} {v[p]}" for p in ("torch", "transformers", "kvcompile") if v.get(p))
    return (f"> Made by `{record['command']}` at commit {commit} on {m['cpu']} ({flags}), {record['threads']} "
            f"threads of {m['cores']} cores, read bandwidth {m['bandwidth_gbs']['read']:.1f} GB/s{gpu}; {versions}. "
            f"Everything else it was made with: `{record_file}`.")


class Results:
    """The files of one result (``<stem>.json``, ``.md``, ``.png``, ...) and the record beside them, rewritten at
    every write so that a run cut short still says what made the files it left."""

    def __init__(self, script: str, out: str | Path | None = None, name: str | None = None):
        self.stem = Path(out) if out else default_stem(script, name)
        self.files: list[str] = []
        self.started = _now()
        repository()
        machine()  # measured now, before the run: a speed table's bandwidth is the one its run started with

    def path(self, suffix: str) -> Path:
        """The file ``<stem><suffix>`` (``suffix`` may start with "/": a file in a folder named by the stem), its
        folder made and its name in the record: for a writer that needs a path (a store, a gzip file)."""
        path = Path(f"{self.stem}{suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        name = path.relative_to(self.stem.parent).as_posix()
        if name not in self.files:
            self.files.append(name)
        self.write_record()
        return path

    def json(self, data, suffix: str = ".json", indent: int | None = 1) -> Path:
        """``data`` as JSON (``indent=None``: one line, for a large result rewritten after every run)."""
        path = self.path(suffix)
        path.write_text(json.dumps(data, indent=indent) + "\n")
        return path

    def markdown(self, text: str, suffix: str = ".md") -> Path:
        """``text`` with the record's header paragraph after its title (at the top where it has none)."""
        path = self.path(suffix)
        path.write_text(_with_header(text, self.header()))
        return path

    def figure(self, fig, suffix: str = ".png", dpi: int = 120) -> Path:
        """A matplotlib figure saved (and closed: a long run makes many)."""
        import matplotlib.pyplot as plt

        path = self.path(suffix)
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        return path

    def adopt(self, paths) -> list[Path]:
        """Files another writer made at this stem (the sweep's ``write``): named in the record, a Markdown one
        given the header."""
        paths = [Path(p) for p in paths]
        for p in paths:
            self.path(p.name[len(self.stem.name):])
            if p.suffix == ".md":
                p.write_text(_with_header(p.read_text(), self.header()))
        return paths

    def record(self) -> dict:
        """What ``<stem>.record.json`` holds (see the module's docstring)."""
        return {"command": command(), "argv": sys.argv, **repository(),
                "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
                "machine": machine(), "threads": _threads(), "gpu": _gpu(), "environment": environment(),
                "started": self.started, "written": _now(), "files": list(self.files)}

    def header(self) -> str:
        return header(self.record(), self._record_path().name)

    def write_record(self) -> Path:
        path = self._record_path()
        path.write_text(json.dumps(self.record(), indent=1) + "\n")
        return path

    def _record_path(self) -> Path:
        return Path(f"{self.stem}.record.json")


def _with_header(text: str, head: str) -> str:
    """``text`` with ``head`` as its second paragraph when it opens with a "# " title, else its first; a header
    written before (the file rewritten by a resumed run) is replaced."""
    lines = text.splitlines()
    title = lines[:1] if lines and lines[0].startswith("# ") else []
    body = lines[len(title):]
    while body and not body[0].strip():
        body = body[1:]
    if body and body[0].startswith("> Made by `"):
        body = body[1:]
        while body and not body[0].strip():
            body = body[1:]
    parts = ["\n".join(title), head, "\n".join(body)] if title else [head, "\n".join(body)]
    return "\n\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run a command that writes results (a ``kvcompile`` subcommand), then record it like a bench script's."""
    p = argparse.ArgumentParser(description="Run COMMAND, then write <stem>.record.json beside what it wrote "
                                "(and the header into <stem>.md).", usage="python bench/record.py [--out STEM] "
                                "-- COMMAND ...")
    p.add_argument("--out", help="the result's path stem (default: the value of the command's --out)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = args.out or next((b for a, b in zip(cmd, cmd[1:]) if a == "--out"), None)
    if not cmd or not out:
        p.error("give the command after --, and --out where the command has none")
    stem = Path(out).with_suffix("") if Path(out).suffix in (".json", ".md", ".csv", ".sqlite") else Path(out)
    results = Results("", stem)
    code = subprocess.run(cmd).returncode
    if code == 0:
        sys.argv = cmd
        written = stem.parent.glob(stem.name + ".*")
        results.adopt(sorted(f for f in written if not f.name.endswith(".record.json")))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
