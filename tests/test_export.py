"""Export round trip: a fresh process loads the AOTInductor artifact and generates the same greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import left_padded_batch

import kvcompile


def test_export_load_in_fresh_process_generates_same_tokens(llama_cm, tmp_path):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, mask = left_padded_batch([40, 25], total=40)
    expected = cm.generate(ids, mask, max_new_tokens=12, eos_token_id=[])
    kvcompile.export(cm, tmp_path / "artifact")
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = (
        "import json, sys, torch, kvcompile\n"
        f"cm = kvcompile.load({str(tmp_path / 'artifact')!r})\n"
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
        "out = cm.generate(x['ids'], x['mask'], max_new_tokens=12, eos_token_id=[])\n"
        "print(json.dumps({'tokens': out.tolist(), 'stats': cm.cache_stats()['bytes_held']}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected.tolist()
    assert result["stats"] == cm.cache_stats()["bytes_held"]


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
