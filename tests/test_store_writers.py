"""The results writers besides the sweep (tests/test_store.py, tests/test_ray_sweep.py): ``kvcompile lm-eval ...
--store`` writes one row per sample, and the same run data-parallel under torchrun (two CPU processes over gloo,
each scoring half of the documents) stores the same rows (wall time and write time aside); ``kvcompile fidelity
--store`` writes one row per (cell, window) whose pooled KL is the measurement's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lm_eval
import pytest
from conftest import byte_llama, byte_tokenizer, stored_rows

from kvcompile import cli
from kvcompile.eval import report
from kvcompile.eval.store import Store

TASKS = ["kvc_passkey", "kvc_niah_single_1"]
DOCS = 4


def _args(folder, store, out) -> list[str]:
    meta = {"tokenizer": str(folder), "length": 512, "num_samples": DOCS}
    return ["run", "--model", "kvcompile", "--model_args", f"pretrained={folder},recipe=tova,budget=0.5",
            "--tasks", ",".join(TASKS), "--metadata", json.dumps(meta), "--store", str(store),
            "--output_path", str(out)]


def _config(out) -> dict:
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["config"]["kvcompile"]


@pytest.mark.slow
def test_samples_land_in_the_store_and_a_torchrun_pair_stores_the_samestored_rows(tmp_path, capsys):
    folder = tmp_path / "tiny"
    byte_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    one, two = tmp_path / "one.sqlite", tmp_path / "two.sqlite"
    assert cli.main(["lm-eval", *_args(folder, one, tmp_path / "out1")]) == 0
    assert lm_eval.simple_evaluate.__module__ == "lm_eval.evaluator", "the run left lm-eval patched"
    single = stored_rows(one)
    assert {(k[1], k[4]) for k in single} == {(t, d) for t in TASKS for d in range(DOCS)}
    assert all(r["bytes_held"] < 0.6 * r["bytes_full"] and r["recipe"] == "tova" and r["length"] == 512
               and r["query_aware"] == 0 for r in single.values())
    assert len({r["bytes_full"] for r in single.values()}) > 2, "every document should carry its own accounting"
    assert all(1 <= r["uor"] <= 2 for r in single.values()), "tova's UOR, GQA groups of 2"
    assert _config(tmp_path / "out1")["world_size"] == 1 and 1 <= _config(tmp_path / "out1")["uor_mean"] <= 2
    assert "8 of 8 sample rows written" in capsys.readouterr().out

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kvcompile.eval", *_args(folder, two, tmp_path / "out2")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert stored_rows(two) == single
    info = _config(tmp_path / "out2")
    assert info["world_size"] == 2 and info["requests"] == len(TASKS) * DOCS // 2  # rank 0 served half


def test_fidelity_windows_land_in_the_store_and_pool_to_the_measurement(tmp_path):
    folder = tmp_path / "tiny"
    byte_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    db, out = tmp_path / "f.sqlite", tmp_path / "f.json"
    assert cli.main(["fidelity", "--model", str(folder), "--recipes", "random,knorm", "--budgets", "0.25,64",
                     "--context", "96", "--scored", "32", "--windows", "2", "--greedy-tokens", "0",
                     "--out", str(out), "--store", str(db)]) == 0
    measured = {(r["recipe"], r["budget"]): r for r in json.loads(out.read_text())["rows"]}
    with Store(db) as store:
        rows = store.rows()
    assert len(rows) == 3 * 2 * 2 and {r["task"] for r in rows} == {"fidelity"}  # random, knorm, oracle x 2 x 2
    assert {r["budget"] for r in rows} == {"0.25", "64"} and all(r["length"] == 128 for r in rows)
    cells = report.cells(rows)
    assert len(cells) == 6
    for c in cells:
        m = measured[(f"{c['recipe']}@{c['version']}", "64 tokens/head" if c["budget"] == "64" else c["budget"])]
        assert c["kl_mean"] == pytest.approx(m["kl_mean"], rel=1e-6) and c["top1"] == pytest.approx(m["top1"])
        assert c["bytes_held_mean"] == pytest.approx(m["bytes_held_mean"]) and c["score"] is None
        assert c["query_aware"] == (c["recipe"] == "oracle") and c["n"] == 2


def test_store_needs_the_kvcompile_model_and_a_path(tmp_path):
    with pytest.raises(SystemExit, match="--store writes the kvcompile model's results; got --model hf"):
        cli.main(["lm-eval", "run", "--model", "hf", "--tasks", "kvc_passkey", "--store", str(tmp_path / "s.db")])
    with pytest.raises(SystemExit, match="--store needs a path"):
        cli.main(["lm-eval", "run", "--model", "kvcompile", "--tasks", "kvc_passkey", "--store"])
    assert not (tmp_path / "s.db").exists()
