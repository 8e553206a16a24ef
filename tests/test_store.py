"""The results store: migrations from an older schema, resume (stored cells skipped, a changed fingerprint is a
new cell), two writers at once losing nothing, the report, and a tiny-model sweep through the CLI run twice."""

from __future__ import annotations

import csv
import io
import multiprocessing
import sqlite3

import pytest
import torch
from conftest import byte_llama, byte_tokenizer

import kvcompile
from kvcompile import cli
from kvcompile.eval import report, sweep
from kvcompile.eval.store import KEY, MIGRATIONS, VERSION, Store, StoreError

CELL = {"model": "m", "task": "passkey", "length": 512, "seed": 0, "sample": 0, "recipe": "knorm", "version": 1,
        "fingerprint": "aaaa", "budget": "0.5", "format": "float32"}


def test_a_version_1_store_is_migrated_on_opening(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    MIGRATIONS[0](db)  # the version-1 layout, as a version-1 kvcompile wrote it
    db.execute(f"INSERT INTO results ({', '.join(KEY)}, score) VALUES ({', '.join('?' * len(KEY))}, 1.0)",
               tuple(CELL.values()))
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with Store(path) as store:
        assert store.version == VERSION == 4
        (old,) = store.rows()
        assert old["score"] == 1.0 and old["created"] is None and old["uor"] is None and store.has(CELL)
        assert store.add([{**CELL, "sample": 1, "score": 0.0, "uor": 1.25}]) == 1
        assert store.rows()[1]["uor"] == 1.25
        assert store.rows()[1]["created"] is not None and store.rows()[1]["torch_version"] == torch.__version__
    with Store(path) as store:  # reopening a current store changes nothing
        assert store.version == VERSION and len(store.rows()) == 2


def test_refuses_a_newer_schema_and_files_that_are_not_stores(tmp_path):
    newer = tmp_path / "newer.sqlite"
    sqlite3.connect(newer).execute(f"PRAGMA user_version = {VERSION + 1}").connection.close()
    with pytest.raises(StoreError, match=f"schema version {VERSION + 1}, newer than version {VERSION}"):
        Store(newer)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(StoreError, match="not a kvcompile results store"):
        Store(other)
    text = tmp_path / "notes.txt"
    text.write_text("not a database " * 100)
    with pytest.raises(StoreError, match="not a SQLite database"):
        Store(text)
    with Store(tmp_path / "s.sqlite") as store, pytest.raises(ValueError, match=r"missing \['budget'\]"):
        store.add([{**CELL, "budget": None}])


def test_a_stored_success_is_final_a_failure_is_retried_and_a_new_fingerprint_is_a_new_cell(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        assert not store.has(CELL)
        assert store.add([{**CELL, "error": "RuntimeError: out of memory"}]) == 1
        assert not store.has(CELL)  # a failure is not done: the next run retries it
        assert store.add([{**CELL, "score": 0.5}]) == 1 and store.has(CELL) and not store.has(CELL, kl=True)
        assert store.add([{**CELL, "score": 0.9, "kl_mean": 0.1}]) == 1  # adds the missing KL
        assert store.add([{**CELL, "score": 0.0, "kl_mean": 0.2}]) == 0  # a success with KL is final
        assert store.has(CELL, kl=True) and [r["score"] for r in store.rows()] == [0.9]
        changed = {**CELL, "fingerprint": "bbbb"}  # same recipe@version, other behaviour
        assert not store.has(changed) and store.add([changed]) == 1 and len(store.rows()) == 2


def _write(path, first: int, barrier) -> None:
    barrier.wait()
    store = Store(path)  # both open the new store at once: one migrates it, the other waits and finds it migrated
    for i in range(first, first + 500):
        store.add([{**CELL, "sample": i, "score": float(first)}])  # one transaction per row: the most contention


def test_two_writers_at_once_lose_nothing_and_duplicate_nothing(tmp_path):
    path, ctx = tmp_path / "shared.sqlite", multiprocessing.get_context("fork")  # fork: no second torch import
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_write, args=(path, first, barrier)) for first in (0, 250)]  # 250-499 by both
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    with Store(path) as store:
        rows = store.rows()
    assert sorted(r["sample"] for r in rows) == list(range(750))
    assert all(r["score"] == (0.0 if r["sample"] < 250 else 250.0) for r in rows if not 250 <= r["sample"] < 500)


def _row(recipe, budget, sample, score, held, **extra):
    return {**CELL, "recipe": recipe, "budget": budget, "sample": sample, "score": score, "bytes_held": held,
            "bytes_allocated": held + 512, "bytes_full": 4096, "wall_s": 1.0, "provenance": "peer", **extra}


def test_report_renders_tables_and_the_plot(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        store.add([_row("full", "1", i, 1.0, 4096, kl_mean=0.0, kl_p99=0.0, top1=1.0, kl_tokens=10) for i in (0, 1)]
                  + [_row("knorm", "0.5", 0, 1.0, 2048, kl_mean=0.1, kl_p99=0.3, top1=0.9, kl_tokens=10, uor=1.5),
                     _row("knorm", "0.5", 1, 0.0, 2048, kl_mean=0.4, kl_p99=0.9, top1=0.6, kl_tokens=30, uor=2.0),
                     _row("knorm", "0.5", 2, None, 0, bytes_held=None, bytes_allocated=None, error="ValueError: boom"),
                     _row("knorm", "0.5", 0, 1.0, 1024, length=1024)])
        rows = store.rows()
    cells = report.cells(rows)
    knorm = next(c for c in cells if c["recipe"] == "knorm" and c["length"] == 512)
    assert knorm["n"] == 2 and knorm["score"] == 0.5 and knorm["held_fraction"] == 0.5
    assert knorm["kl_mean"] == pytest.approx((0.1 * 10 + 0.4 * 30) / 40) and knorm["kl_p99"] == 0.9
    assert knorm["top1"] == pytest.approx(0.675) and knorm["error"] == "ValueError: boom" and knorm["wall_s"] == 3.0
    md = report.markdown(rows)
    assert md.count("## m @ ") == 2 and "## m @ 512 tokens, float32" in md
    assert knorm["uor"] == 1.75  # mean over the samples that succeeded
    row = "| passkey | knorm@1 | aaaa | peer | 0.5 | 2 | 0.50 | 2 | 0.500 | 1.75 | 3.0 | 0.325 | 0.90 | 0.68 | - |"
    assert row in md
    table = list(csv.DictReader(io.StringIO(report.csv_text(cells))))
    assert len(table) == 3 and table[1]["recipe"] == "knorm" and float(table[1]["score"]) == 0.5
    assert report.plot(cells, tmp_path / "plot.png").stat().st_size > 0


@pytest.fixture(scope="module")
def tiny():
    model = byte_llama()
    return byte_tokenizer(), kvcompile.apply(model, budget=1.0, recipe="full")


def test_sweep_rows_carry_their_scorers_union_overhead(tiny, tmp_path):
    """UOR in the store: between 1 and the group size for a scorer with a per-query-head form (h2o), None for one
    without (knorm) and for the full cache."""
    tok, cm = tiny
    with Store(tmp_path / "s.sqlite") as store:
        sweep.run(cm, tok, ["knorm", "h2o"], [0.25], ["passkey"], n_samples=1, length=512, progress=False,
                  store=store, model="tiny")
        uor = {r["recipe"]: r["uor"] for r in store.rows()}
    group = cm.spec.num_q_heads // cm.spec.num_kv_heads
    assert uor["full"] is None and uor["knorm"] is None and 1.0 <= uor["h2o"] <= group


def test_sweep_resumes_from_the_store_and_a_changed_recipe_runs_again(tiny, tmp_path):
    tok, cm = tiny
    grid = dict(budgets=[0.5], tasks=["passkey"], n_samples=1, length=512, kl=True, progress=False, model="tiny")
    mine = kvcompile.Recipe("mine", "snapkv", scorer_args={"window": 4})
    with Store(tmp_path / "s.sqlite") as store:
        first = sweep.run(cm, tok, ["knorm", mine], store=store, **grid)
        assert first["timing"]["cells_stored"] == 0 and len(store.rows()) == 3  # full, knorm, mine
        stored = {(c["recipe"], c["budget"]): c for c in report.cells(store.rows())}
        for c in first["rows"]:  # the sweep's table is the store's report
            assert {k: c[k] for k in ("score", "n", "bytes_held_mean", "kl_mean", "top1")} == {
                k: stored[(c["recipe"], c["budget"])][k] for k in ("score", "n", "bytes_held_mean", "kl_mean", "top1")}
        again = sweep.run(cm, tok, ["knorm", mine], store=store, **grid)
        assert again["timing"]["cells_stored"] == 3 and again["timing"]["contexts"] == 0 and len(store.rows()) == 3
        changed = kvcompile.Recipe("mine", "snapkv", scorer_args={"window": 8})  # mine@1 doing something else
        third = sweep.run(cm, tok, ["knorm", changed], store=store, **grid)
        assert third["timing"]["cells_stored"] == 2 and len(store.rows()) == 4
        prints = {r["fingerprint"] for r in store.rows() if r["recipe"] == "mine"}
        assert prints == {mine.fingerprint, changed.fingerprint} and len(prints) == 2
    with pytest.raises(ValueError, match="keys every row by model"):
        sweep.run(cm, tok, ["knorm"], store=Store(tmp_path / "t.sqlite"), **{**grid, "model": ""})


def test_cli_eval_with_a_store_twice_then_report(tmp_path, capsys):
    folder, db = tmp_path / "tiny", str(tmp_path / "grid.sqlite")
    byte_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    args = ["eval", "--model", str(folder), "--recipes", "knorm,streamingllm", "--budgets", "0.5",
            "--tasks", "passkey", "--n-samples", "2", "--length", "512", "--store", db]
    assert cli.main(args) == 0
    with Store(db) as store:
        rows = store.rows()
    assert len(rows) == 2 * 3 and not (tmp_path / "bench").exists()  # (full, knorm, streamingllm) x 2 samples
    assert cli.main(args) == 0
    assert "0 cell samples run, 6 found stored" in capsys.readouterr().err
    with Store(db) as store:
        assert store.rows() == rows  # nothing added, nothing rewritten
    assert cli.main(["report", "--store", db, "--plot", str(tmp_path / "grid.png")]) == 0
    md = capsys.readouterr().out
    assert md.count("| passkey | ") == 3 and "streamingllm@" in md and (tmp_path / "grid.png").exists()
    assert cli.main(["report", "--store", db, "--format", "csv"]) == 0
    assert len(list(csv.DictReader(io.StringIO(capsys.readouterr().out)))) == 3
