"""The capture cache: a second ``apply`` on the same model reads its programs from disk instead of tracing it
again, gives the same tokens, is invalidated by a change of config or dtype, and never unpickles anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import left_padded_batch, tiny_model

import kvcompile


@pytest.fixture
def exports(monkeypatch):
    """Counts ``torch.export.export`` calls: the capture's trace."""
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _logits(cm):
    ids, mask = left_padded_batch([24, 17], total=24, seed=3)
    return cm.prefill(ids, mask), cm.generate(ids, attention_mask=mask, max_new_tokens=6)


def test_a_second_apply_reads_the_programs_from_disk_and_gives_the_same_tokens(tmp_path, exports):
    model = tiny_model("llama")
    cold = kvcompile.apply(model, budget=0.5, recipe="snapkv", page_size=4, capture_cache=tmp_path)
    assert len(exports) == 1 and len(list(tmp_path.iterdir())) == 1
    warm = kvcompile.apply(model, budget=0.5, recipe="snapkv", page_size=4, capture_cache=tmp_path)
    assert len(exports) == 1, "the second apply traced the model again"
    (a_logits, a_tokens), (b_logits, b_tokens) = _logits(cold), _logits(warm)
    assert torch.equal(a_logits, b_logits) and torch.equal(a_tokens, b_tokens)
    # the cached programs compile like captured ones (a compiled decode, same tokens)
    compiled = kvcompile.apply(warm, budget=0.5, recipe="snapkv", page_size=4, compile="eager")
    assert torch.equal(_logits(compiled)[1], a_tokens)


def test_the_graphs_read_the_live_weights_not_stored_ones(tmp_path, exports):
    kvcompile.apply(tiny_model("qwen2", seed=0), budget=1.0, recipe="full", capture_cache=tmp_path)
    other = tiny_model("qwen2", seed=1)  # same config, other weights: the same entry serves it
    warm = kvcompile.apply(other, budget=1.0, recipe="full", capture_cache=tmp_path)
    fresh = kvcompile.apply(other, budget=1.0, recipe="full", capture_cache=False)
    assert len(exports) == 2  # the first apply and the uncached one
    assert torch.equal(_logits(warm)[0], _logits(fresh)[0])


@pytest.mark.slow
def test_a_change_of_config_or_dtype_captures_again(tmp_path, exports):
    kvcompile.apply(tiny_model("llama"), budget=1.0, recipe="full", capture_cache=tmp_path)
    three_layers = tiny_model("llama", layers=3)
    kvcompile.apply(three_layers, budget=1.0, recipe="full", capture_cache=tmp_path)
    assert len(exports) == 2
    kvcompile.apply(tiny_model("llama").double(), budget=1.0, recipe="full", capture_cache=tmp_path)
    assert len(exports) == 3 and len(list(tmp_path.iterdir())) == 3


@pytest.mark.slow
def test_off_by_argument_or_environment(tmp_path, exports, monkeypatch):
    model = tiny_model("llama")
    kvcompile.apply(model, budget=1.0, recipe="full", capture_cache=False)
    monkeypatch.setenv("KVCOMPILE_PROGRAM_CACHE", "0")
    kvcompile.apply(model, budget=1.0, recipe="full")
    monkeypatch.setenv("KVCOMPILE_PROGRAM_CACHE", str(tmp_path))
    kvcompile.apply(model, budget=1.0, recipe="full")
    kvcompile.apply(model, budget=1.0, recipe="full")
    assert len(exports) == 3 and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(TypeError, match="capture_cache"):
        kvcompile.apply(model, budget=1.0, recipe="full", capture_cache=3)


@pytest.mark.slow
def test_an_entry_naming_a_foreign_target_or_broken_is_captured_again(tmp_path, exports):
    model = tiny_model("llama")
    kvcompile.apply(model, budget=1.0, recipe="full", capture_cache=tmp_path)
    (entry,) = tmp_path.iterdir()
    graphs = entry / "graphs.json"
    stored = json.loads(graphs.read_text())
    node = next(n for n in stored["graphs"]["prefill"] if n[1] == "call_function")
    node[2] = "builtins.eval"  # a stored entry must not be able to make a load call arbitrary code
    graphs.write_text(json.dumps(stored))
    cm = kvcompile.apply(model, budget=1.0, recipe="full", capture_cache=tmp_path)
    assert len(exports) == 2
    graphs.write_text("{not json")
    kvcompile.apply(model, budget=1.0, recipe="full", capture_cache=tmp_path)
    assert len(exports) == 3
    assert torch.isfinite(_logits(cm)[0]).all()


@pytest.mark.slow
def test_loading_from_the_cache_unpickles_nothing(tmp_path):
    script = (  # a fresh process: the first apply stores, the second loads with every unpickler refusing
        "import pickle, sys, torch, kvcompile\n"
        "sys.path.insert(0, 'tests')\n"
        "from conftest import tiny_model\n"
        "model = tiny_model('llama')\n"
        f"kvcompile.apply(model, budget=1.0, recipe='full', capture_cache={str(tmp_path)!r})\n"
        "def refuse(*a, **k): raise AssertionError('the capture cache unpickled something')\n"
        "class Refused(pickle.Unpickler):\n    def __init__(self, *a, **k): refuse()\n"
        "pickle.load = pickle.loads = torch.load = refuse; pickle.Unpickler = Refused\n"
        "real = torch.export.export\n"
        "torch.export.export = lambda *a, **k: refuse()\n"
        f"cm = kvcompile.apply(model, budget=1.0, recipe='full', capture_cache={str(tmp_path)!r})\n"
        "print(cm.prefill(torch.tensor([[3, 4, 5]])).shape)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([1, 3, 96])" in out.stdout
