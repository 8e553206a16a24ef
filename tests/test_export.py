"""Export round trip: a fresh process loads the AOTInductor artifact and generates the same greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import left_padded_batch

import kvcompile

MINIMA_W8 = dataclasses.replace(kvcompile.recipes()["minima-kv"], name="minima-kv-r8", precise_recent=8)
KIVI2_W8 = dataclasses.replace(kvcompile.recipes()["kivi2"], name="kivi2-r8", precise_recent=8)
# every other page format, and the weighted-entry recipes beyond CertKV (one artifact each, about a minute on 2
# cores; the suite's time limit keeps them out of the default run): KVCOMPILE_LONG=1
LONG = ["gracekv", "core", "snapkv+int4", "snapkv+fp16", "snapkv+bf16", "snapkv+fp8", "snapkv+int8", "snapkv+int3",
        "snapkv+int2", "snapkv+k8v4", "snapkv+kivi4", KIVI2_W8, "snapkv+spectra4", "snapkv+think"]


@pytest.mark.parametrize("recipe, budget", [("certkv", 0.5)] + [
    (MINIMA_W8, 0.8), ("anchorkv", 1.0)] + [
    pytest.param(r, 0.5, marks=[pytest.mark.slow, pytest.mark.skipif("KVCOMPILE_LONG" not in os.environ,
                                                                      reason="KVCOMPILE_LONG=1")]) for r in LONG],
    ids=lambda r: str(getattr(r, "name", r)))
@pytest.mark.slow
def test_export_load_in_fresh_process_generates_same_tokens(llama_cm, tmp_path, recipe, budget):
    """Over model-dtype pages holding weighted entries (CertKV's summaries; with ``KVCOMPILE_LONG=1`` GraceKV's
    prototypes and CORE's memory too: the log-weight channel is an input of every program, its pages a dimension of
    their own), and over page formats
    (the format pool is an input too): Minima-KV's TQ3 (packed page-local codes, precise anchors, demotion while
    decoding), AnchorKV's rows (its per-sequence anchor and residual tables two inputs of their own), and with
    ``KVCOMPILE_LONG=1`` every other format: ThinK's pruned key channels (a per-head channel list), SPECTRA's rows
    (the basis an input of its own), the row-local integer codes and KIVI's demoting window."""
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)  # Minima's anchors: 0.5 is too little
    ids, mask = left_padded_batch([40, 25], total=40)
    expected = cm.generate(ids, mask, max_new_tokens=12, eos_token_id=[])
    kvcompile.export(cm, tmp_path / "artifact")
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = (  # loading the artifact must not unpickle anything: every unpickler raises while it loads
        "import json, pickle, sys, torch, kvcompile\n"
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
        "def refuse(*a, **k): raise AssertionError('kvcompile.load unpickled something')\n"
        "class Refused(pickle.Unpickler):\n    def __init__(self, *a, **k): refuse()\n"
        "saved = pickle.load, pickle.loads, pickle.Unpickler, torch.load\n"
        "pickle.load = pickle.loads = torch.load = refuse; pickle.Unpickler = Refused\n"
        f"cm = kvcompile.load({str(tmp_path / 'artifact')!r})\n"
        "pickle.load, pickle.loads, pickle.Unpickler, torch.load = saved\n"
        "out = cm.generate(x['ids'], x['mask'], max_new_tokens=12, eos_token_id=[])\n"
        "print(json.dumps({'tokens': out.tolist(), 'stats': cm.cache_stats()['bytes_held']}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected.tolist()
    assert result["stats"] == cm.cache_stats()["bytes_held"]
    if recipe == "certkv":
        check_broken_artifacts(tmp_path / "artifact", tmp_path)


def check_broken_artifacts(good, tmp_path):
    """Each way an artifact can be broken gets an error that names the file and the problem."""
    def broken(name, edit):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def drop_key(key):
        def edit(folder):
            meta = json.loads((folder / "kvcompile.json").read_text())
            del meta[key]
            (folder / "kvcompile.json").write_text(json.dumps(meta))
        return edit

    cases = [
        (drop_key("spec"), ValueError, r"kvcompile.json has no 'spec'"),
        (lambda f: (f / "kvcompile.json").write_text("{not json"), ValueError, r"kvcompile.json is not valid JSON"),
        (lambda f: (f / "decode.pt2").write_bytes(b"garbage"), ValueError,
         r"decode.pt2 is not a loadable aoti package"),
        (lambda f: (f / "prefill.pt2").unlink(), FileNotFoundError, r"prefill.pt2 is missing"),
        (lambda f: (f / "kvcompile.json").unlink(), FileNotFoundError, r"kvcompile.json is missing"),
    ]
    for i, (edit, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            kvcompile.load(broken(f"broken{i}", edit))


def test_export_errors(llama_cm, tmp_path):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv")
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:  # the usual case here: the error names the missing package and nothing is written
        with pytest.raises(ImportError, match="torch_tensorrt"):
            kvcompile.export(cm, tmp_path / "trt", backend="tensorrt")
        assert not (tmp_path / "trt").exists()
    else:
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="CUDA"):
                kvcompile.export(cm, tmp_path / "trt", backend="tensorrt")
    with pytest.raises(ValueError, match="unknown export backend"):
        kvcompile.export(cm, tmp_path, backend="onnx")
    with pytest.raises(FileNotFoundError, match="not a kvcompile export"):
        kvcompile.load(tmp_path)
    with pytest.raises(ValueError, match="loaded from an artifact|no source module"):
        kvcompile.CompressedModel(cm.programs, cm.spec, cm.recipe, cm.budget).to(torch.float64)
