"""Sweeps on Ray (``kvcompile eval --executor ray``) on a local 2-CPU cluster: a tiny-model grid (3 recipes x 2
budgets x 2 tasks x 4 samples) run in two sittings, a worker killed in the second, stores exactly the rows the
local executor stores (wall time and write time aside), each once."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import byte_llama, byte_tokenizer, stored_rows

from kvcompile import cli

ray = pytest.importorskip("ray", reason="the Ray executor needs the ray extra: pip install 'kvcompile[ray]'")

GRID = ["--recipes", "knorm,streamingllm,snapkv", "--budgets", "0.5,0.25", "--tasks", "passkey,niah_single_1",
        "--length", "512", "--kl"]
CELLS = 1 + 3 * 2  # the full cell, then every recipe at every budget


def _kill_a_sweep_worker(killed: list) -> None:
    """From beside the driver: kill the first sweep worker that appears, with its unit in flight."""
    deadline = time.time() + 300
    while time.time() < deadline and not killed:
        names = [n for n in ray.util.list_named_actors() if n.startswith("kvcompile-sweep")]
        if names:
            ray.kill(ray.get_actor(names[0]), no_restart=True)
            killed.append(names[0])
        time.sleep(0.1)


@pytest.mark.slow
def test_a_ray_grid_resumed_with_a_worker_killed_stores_what_the_local_executor_stores(tmp_path, capsys):
    folder = tmp_path / "tiny"
    byte_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    local, on_ray = str(tmp_path / "local.sqlite"), str(tmp_path / "ray.sqlite")
    assert cli.main(["eval", "--model", str(folder), *GRID, "--n-samples", "4", "--store", local]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray_args = ["eval", "--model", str(folder), *GRID, "--store", on_ray, "--executor", "ray"]
        assert cli.main([*ray_args, "--n-samples", "2"]) == 0  # the first sitting: half the samples
        assert len(stored_rows(on_ray)) == 2 * 2 * CELLS
        killed = []
        killer = threading.Thread(target=_kill_a_sweep_worker, args=(killed,))
        killer.start()
        assert cli.main([*ray_args, "--n-samples", "4"]) == 0  # resumes: only the new samples run
        killer.join()
        assert killed, "no sweep worker was found to kill"
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    assert f"{2 * 2 * CELLS} found stored and skipped" in err and "lost its worker" in err
    expected, got = stored_rows(local), stored_rows(on_ray)
    assert len(expected) == 2 * 4 * CELLS
    assert got.keys() == expected.keys(), "missing or extra cells"
    for key, row in expected.items():
        assert got[key] == row, key
