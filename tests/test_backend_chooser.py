"""The backend chooser (``kernels.chooser``, issue 49): a native kernel runs only where it measured faster than the
PyTorch path; the choice is kept on disk per CPU, flags, threads and build, reused by a new process and measured
again when any of those change; a bad cache file is ignored with a warning. ``kvcompile doctor`` reports it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvcompile import cli
from kvcompile.kernels import chooser, cpu_native
from kvcompile.passes.streamed_linear import streamed_linear

BUILD = "test-build"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache folder and process memo, and choices by measuring (the native library as the suite builds it)."""
    cpu_native.library()
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path))
    monkeypatch.delenv("KVCOMPILE_DECODE_BACKEND", raising=False)
    monkeypatch.setattr(chooser, "_memo", {})
    return tmp_path


def fakes(native_s: float, calls: list | None = None):
    """A native kernel taking ``native_s`` a call (counted in ``calls``) and a reference taking 2 ms."""
    def native(x):
        (calls if calls is not None else []).append(1)
        time.sleep(native_s)

    return native, lambda x: time.sleep(0.002), lambda: [(0,)]


def choose(native_s: float, shape: tuple = (1,), calls: list | None = None, build: str = BUILD) -> chooser.Choice:
    return chooser.choose("op", shape, *fakes(native_s, calls), build)


def test_the_faster_path_is_chosen_in_bounded_time():
    start = time.perf_counter()
    slow, fast = choose(0.004, (1,)), choose(0.0, (2,))
    assert time.perf_counter() - start < 2 * (chooser.BUDGET_S + 0.1)
    assert not slow.native and slow.native_s > slow.reference_s and "native slower" in slow.reason
    assert fast.native and fast.native_s < fast.reference_s and "faster" in fast.reason


def test_a_slow_native_projection_is_not_run(monkeypatch):
    """The projection through ``streamed_linear`` goes to PyTorch where the native kernel measured slower."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the PyTorch path serves")
    calls, native = [], cpu_native.linear
    monkeypatch.setattr(cpu_native, "linear", lambda x, w: calls.append(1) or time.sleep(0.001) or native(x, w))
    x, w = torch.randn(1, 64), torch.randn(48, 64)
    assert not cpu_native.linear_choice(64, 48).native and calls, "timed"
    calls.clear()
    torch.testing.assert_close(streamed_linear(x, w), torch.nn.functional.linear(x, w))
    assert not calls, "the slower native projection is not called"


def test_a_slow_native_decode_is_not_run(monkeypatch):
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the PyTorch path serves")
    native = cpu_native._native_attend
    monkeypatch.setattr(cpu_native, "_native_attend", lambda *a: time.sleep(0.05) or native(*a))
    k, v = torch.randn(9, 4, 32), torch.randn(9, 4, 32)
    q, table = torch.randn(1, 2, 2, 32), torch.arange(1, 9, dtype=torch.int32).view(1, 2, 4)
    assert cpu_native.serves(q, (None, k, None), (None, v, None))
    assert cpu_native.attend(q, (None, k, None), (None, v, None), table, torch.full((1, 2), 13)) is None
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "native")
    assert cpu_native.attend(q, (None, k, None), (None, v, None), table, torch.full((1, 2), 13)) is not None


def test_a_new_process_reuses_the_choice(cache):
    first = choose(0.0)
    path = chooser.cache_path(chooser.identity(BUILD))
    kept = path.read_bytes()
    assert first.source == "measured" and json.loads(kept)["choices"]["op 1"]["native"]
    code = f"""
import torch
torch.set_num_threads({torch.get_num_threads()})
from kvcompile.kernels import chooser

def timed(*args):
    raise AssertionError("timed again")

choice = chooser.choose("op", (1,), timed, timed, lambda: [(0,)], {BUILD!r})
print(choice.source, choice.native)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVCOMPILE_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cached", "True"]
    assert path.read_bytes() == kept


def test_new_flags_a_new_build_or_other_threads_measure_again(monkeypatch):
    calls = []
    choose(0.0, calls=calls)
    assert calls and choose(0.0, calls=(again := [])).native and not again, "memoised in the process"
    monkeypatch.setattr(chooser, "_memo", {})
    assert choose(0.0, calls=again).source == "cached" and not again, "kept on disk"
    model, flags = chooser.cpu()
    changes = [lambda: monkeypatch.setattr(chooser, "cpu", lambda: (model, (*flags, "avx10_2"))),
               lambda: monkeypatch.setattr(torch, "get_num_threads", lambda: 97)]
    for change in changes:
        change()
        monkeypatch.setattr(chooser, "_memo", {})
        assert choose(0.0, calls=(again := [])).source == "measured" and again
    assert choose(0.0, calls=(again := []), build="another-build").source == "measured" and again


@pytest.mark.parametrize("bad", ["not json", '{"identity": {}, "choices": {}}', "[]", "directory"])
def test_a_bad_cache_file_is_ignored_with_a_warning(bad, cache):
    """Garbage, another machine's file, the wrong structure, or a file that cannot be read (a folder in its place:
    a mode of 000 does not stop root): a warning naming it, a fresh measurement, never a crash."""
    path = chooser.cache_path(chooser.identity(BUILD))
    path.parent.mkdir(parents=True)
    path.mkdir() if bad == "directory" else path.write_text(bad)
    with pytest.warns(UserWarning) as warned:
        choice = choose(0.0)
    assert choice.native and choice.source == "measured"
    said = [str(w.message) for w in warned]
    assert said[0].startswith(f"kvcompile: ignoring the backend choices in {path} (")
    if bad == "directory":
        assert said[1:] == [f"kvcompile: could not keep the backend choice in {path} ({said[1].split(' (', 1)[1]}"]
    else:  # the file is written anew, with the choice
        assert len(said) == 1 and json.loads(path.read_text())["choices"]["op 1"]["native"]


def test_nothing_is_timed_while_tracing(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    choice = choose(0.0, calls=calls)
    assert not choice.native and not calls and "tracing" in choice.reason


def test_the_override_forces_either_backend_unmeasured(monkeypatch):
    calls = []
    for backend, native in (("native", True), ("reference", False)):
        monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
        choice = choose(0.004, calls=calls)
        assert choice.native == native and choice.reason == f"forced by KVCOMPILE_DECODE_BACKEND={backend}"
    assert not calls


DOCTOR = ["doctor", "--hidden-size", "64", "--intermediate-size", "96", "--heads", "4", "--kv-heads", "2",
          "--head-dim", "64", "--formats", "fp32,int8"]


def test_doctor_says_the_machine_and_each_choice(monkeypatch, capsys):
    monkeypatch.setattr(chooser, "read_bandwidth", lambda: 12.5)
    assert cli.main(DOCTOR) == 0
    out = capsys.readouterr().out
    model, flags = chooser.cpu()
    assert f"CPU: {model}" in out and "read bandwidth: 12.5 GB/s" in out and "threads" in out
    assert all(f in out for f in chooser.ISA if f in flags)
    ops = ["linear 64->256", "linear 64->128", "linear 64->96", "linear 96->64", "decode fp32 D64 G2 P16",
           "decode int8 D64 G2 P16"]
    lines = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith(("linear", "decode"))}
    assert sorted(lines) == sorted(ops)
    built = cpu_native.library() is not None
    assert all(("faster" in line or "slower" in line) if built else "not built" in line for line in lines.values())
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "reference")
    assert cli.main(DOCTOR) == 0
    out = capsys.readouterr().out
    assert out.count("forced by KVCOMPILE_DECODE_BACKEND=reference") == len(lines)


def test_doctor_remeasure_forgets_the_kept_choices(monkeypatch, capsys):
    """A kept choice (here one doctored to a timing no kernel takes) is shown as cached by a new process, and
    measured afresh with ``--remeasure``."""
    if cpu_native.library() is None:
        pytest.skip("no native library on this machine: nothing is measured")
    monkeypatch.setattr(chooser, "read_bandwidth", lambda: 12.5)
    assert cli.main(DOCTOR) == 0
    path = chooser.cache_path(chooser.identity(cpu_native.build_key()))
    kept = json.loads(path.read_text())
    for choice in kept["choices"].values():
        choice["native_s"] = 123.0  # 123 s a call
    path.write_text(json.dumps(kept))
    monkeypatch.setattr(chooser, "_memo", {})  # a new process
    capsys.readouterr()
    assert cli.main(DOCTOR) == 0
    assert "123000000.0 us" in capsys.readouterr().out
    assert cli.main([*DOCTOR, "--remeasure"]) == 0
    out = capsys.readouterr().out
    assert "123000000.0 us" not in out and "(cached)" not in out
