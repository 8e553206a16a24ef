"""A sweep's contexts on Ray workers: one unit per (task, sample), each worker an actor that loads the model once.

The driver (the calling process) decides what runs (contexts whose cells are all in the store are skipped, as in
``sweep.run``), hands one unit at a time to each idle worker, and writes each unit's rows to the store the moment
they land. The driver is the only writer, and a unit's rows arrive once, as a whole, so no row is written twice;
a unit whose worker dies goes back to the queue and a fresh worker replaces the dead one (loading the model
again). Workers run ``sweep.Sweeper``, the code a local sweep runs, so they store the same rows.

    kvcompile eval --model smollm2-135m --recipes snapkv,knorm --budgets 0.25 --store grid.sqlite --executor ray

Ray is the optional extra ``kvcompile[ray]``; ``--address`` joins a running cluster (``auto`` or HOST:PORT),
otherwise a local one is started on this machine's CPUs and stopped at the end.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import sys

from tqdm import tqdm

from . import sweep
from .store import Store, cell_keys
from .synthetic import get_task

RETRIES = 3  # times one unit may lose its worker before the sweep gives up
DTYPE = "float32"  # the workers' model and cache dtype (what the store's keys name)


class Worker:
    """A Ray actor's state: the model, loaded once, and the sweep's ``Sweeper`` over it."""

    def __init__(self, model: str, cells: list, length: int, seed: int, kl: bool, threads: int):
        import torch

        import kvcompile

        torch.set_num_threads(threads)
        hf, tokenizer = kvcompile.load_model(model, dtype=getattr(torch, DTYPE))
        cm = kvcompile.apply(hf, budget=1.0, recipe="full")
        self.sweeper = sweep.Sweeper(cm, tokenizer, cells, length=length, seed=seed, kl=kl, model=model)

    def run_context(self, task: str, index: int, stored: list[bool]) -> dict:
        return self.sweeper.run_context(task, index, stored)


def run(model: str, recipes: list, budgets: list, tasks: list[str], *, n_samples: int = 10, length: int = 1024,
        seed: int = 0, kl: bool = False, store: Store | None = None, address: str | None = None,
        workers: int | None = None, cpus_per_worker: int = 1, progress: bool = True) -> dict:
    """``sweep.run`` on Ray: the same rows and result, with ``model`` a name every worker can load
    (``kvcompile.load_model``). ``workers``: how many actors (default: the cluster's CPUs over ``cpus_per_worker``),
    each running torch on ``cpus_per_worker`` threads."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("--executor ray needs Ray: pip install 'kvcompile[ray]'") from e
    if store is not None and not model:
        raise ValueError("a store keys every row by model: pass run(..., store=store, model='smollm2-135m')")
    for task in tasks:  # an unknown task fails here, before any worker starts
        get_task(task)
    cells = sweep.grid(recipes, budgets)
    started, pool = not ray.is_initialized(), []
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        actor, names = ray.remote(num_cpus=cpus_per_worker)(Worker), itertools.count()

        def spawn():  # named, so the cluster's tools show which actors a sweep holds
            pool.append(actor.options(name=f"kvcompile-sweep-{os.getpid()}-{next(names)}").remote(
                model, cells, length, seed, kl, cpus_per_worker))
            return pool[-1]

        units = [(t, i) for t in tasks for i in range(n_samples)]
        keys = {u: cell_keys(cells, model, *u, length, seed, DTYPE) for u in units}
        count = workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // cpus_per_worker)
        return _drive(ray, count, spawn, units, keys, cells, store, kl, progress,
                      (budgets, tasks, n_samples, length, seed))
    finally:
        for worker in pool if ray.is_initialized() else ():
            ray.kill(worker, no_restart=True)  # the models they hold are freed with them
        if started:
            ray.shutdown()


def _drive(ray, count, spawn, units, keys, cells, store, kl, progress, config) -> dict:
    """Hand the units whose cells are not all stored to ``count`` workers (at most one per unit), one at a time to
    each idle worker, until every one has landed."""
    timing, samples, lost = sweep.new_timing(), [], collections.Counter()
    stored = {u: [store is not None and store.has(k, kl=kl) for k in keys[u]] for u in units}
    timing["cells_stored"] = sum(map(sum, stored.values()))
    todo = collections.deque(u for u in units if not all(stored[u]))
    bar = tqdm(total=len(units) * len(cells), disable=not progress, desc="sweep (ray)")
    bar.update(len(cells) * (len(units) - len(todo)))
    idle, running = [spawn() for _ in range(min(count, len(todo)))], {}
    while todo or running:
        while todo and idle:
            worker, unit = idle.pop(), todo.popleft()
            running[worker.run_context.remote(*unit, stored[unit])] = (worker, unit)
        [ref], _ = ray.wait(list(running), num_returns=1)
        worker, unit = running.pop(ref)
        try:
            done = ray.get(ref)
        except ray.exceptions.RayActorError as e:  # the worker died: a fresh one takes its place, the unit requeues
            lost[unit] += 1
            if lost[unit] > RETRIES:
                raise RuntimeError(f"sweep unit {unit} lost its worker {lost[unit]} times; last: {e}") from e
            bar.write(f"sweep unit {unit} lost its worker ({type(e).__name__}); it runs again on a fresh one",
                      file=sys.stderr)
            ray.kill(worker, no_restart=True)
            idle.append(spawn())
            todo.appendleft(unit)
            continue
        idle.append(worker)
        samples += done["rows"]
        sweep.add_timing(timing, done)
        if store is not None:
            store.add(done["rows"])
        bar.update(len(cells))
    bar.close()
    return sweep.result(samples, timing, cells, *config)
