"""Grid evaluation: recipes x budgets x synthetic tasks, one shared prefill per context.

Per context the full-budget model prefills once (``compress=False``: nothing evicted, the queries kept) with the
widest observation window any cell reads; each cell then forks that cache, compresses it (``CompressedModel.fork``
+ ``compress``), reads the question (query-agnostic) and decodes greedily. A grid of K cells costs about one
prefill plus K compress-and-decode steps per context instead of K prefills. Scores are the task definitions' own
(``Sample.score``). Optional columns: next-token KL(full || compressed) and top-1 agreement, teacher-forced on the
question plus the full-budget answer.

A cell that fails records its error and the sweep goes on. With a results store (``eval.store``) each context's
rows are written as soon as its cells are done, and cells already stored are skipped: an interrupted grid resumes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import kvcompile

from .. import observation
from ..budget import Budget
from ..model import CompressedModel
from ..recipes import Recipe, anchors, compose, get_recipe
from . import ledger, report
from .decoding import answer, encode, ids_tensor, read_question
from .fidelity import next_token_metrics, summarize
from .step_tasks import task_segments
from .store import VALUES, Store, cell_keys
from .synthetic import get_task, make_sample
from .uor import held_uor


def parse_budget(text: str) -> float | int | str:
    """"0.25" -> 0.25 (fraction), "512" -> 512 (tokens per KV head), "64MiB" -> "64MiB" (bytes)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def run(
    cm: CompressedModel,
    tokenizer,
    recipes: list,
    budgets: list | None,
    tasks: list[str],
    *,
    n_samples: int = 10,
    length: int = 1024,
    seed: int = 0,
    kl: bool = False,
    ledger_mass: bool = True,
    measure_separate: int = 0,
    progress: bool = True,
    store: Store | None = None,
    model: str = "",
) -> dict:
    """Run the grid; returns ``{"rows": [...], "samples": [...], "timing": {...}, "config": {...}}``: ``rows``
    one per cell (``report.COLUMNS``), ``samples`` one per (cell, sample) as the store holds them.

    ``recipes``: names from ``kvcompile.recipes()`` or ``Recipe`` objects; ``budgets``: anything ``apply`` takes
    (None: ``recipes`` are (recipe, budget) pairs, ``grid``).

    ``cm`` is any ``CompressedModel`` of the model (it is re-targeted, never modified). The full-budget cell is
    always run first (it is the reference for KL). ``measure_separate``: for that many contexts, also run every
    cell as a separate prefill + compress + decode, to time the shared prefill against K separate runs and check
    that both give the same answer. ``ledger_mass``: measure each compressed cell's dropped attention mass for its
    ledger (one more attention pass over the observed window, about a quarter of a sweep's time); off, the ledger
    records it as not measured.

    ``store``: each context's rows are added to it as soon as its cells are done, and a context whose cells
    are all stored already (with KL if ``kl``) is skipped; ``model`` names the model in the rows' key. ``rows``
    and ``samples`` hold only what this call ran.
    """
    if store is not None and not model:
        raise ValueError("a store keys every row by model: pass run(..., store=store, model='smollm2-135m')")
    task_objs = [get_task(t) for t in tasks]
    sweeper = Sweeper(cm, tokenizer, grid(recipes, budgets), length=length, seed=seed, kl=kl, model=model,
                      ledger_mass=ledger_mass)
    cells = sweeper.cells
    timing = new_timing()
    bar = tqdm(total=len(task_objs) * n_samples * len(cells), disable=not progress, desc="sweep")
    samples = []
    for task in task_objs:
        for index in range(n_samples):
            keys = sweeper.keys(task.name, index)
            stored = [store is not None and store.has(k, kl=kl) for k in keys]
            timing["cells_stored"] += sum(stored)
            if all(stored):
                bar.update(len(cells))
                continue
            done = sweeper.run_context(task.name, index, stored)
            add_timing(timing, done)
            bar.update(len(cells))
            samples += done["rows"]
            if store is not None:
                store.add(done["rows"])
            if timing["separate_contexts"] < measure_separate:
                _separate(sweeper.base, cells, done["context"], done["question"], tokenizer, task.max_new_tokens,
                          done["answers"], timing)
                timing["separate_shared_s"] += done["prefill_s"] + done["cells_s"]
    bar.close()
    return result(samples, timing, cells, budgets, tasks, n_samples, length, seed)


def grid(recipes: list, budgets: list | None) -> list[tuple[Recipe, Budget]]:
    """The cells of a sweep: the full-budget cell first (the KL reference), then every recipe at every budget; with
    ``budgets`` None, ``recipes`` are the (recipe, budget) cells themselves (a grid that is not a product)."""
    pairs = [(r, b) for r in recipes for b in budgets] if budgets is not None else recipes
    chosen = [(get_recipe(r), Budget.parse(b)) for r, b in pairs]
    return [(get_recipe("full"), Budget.parse(1.0))] + [(r, b) for r, b in chosen if r.name != "full"]


class Sweeper:
    """A sweep's work on one context (a task sample), whoever runs it (this process, or a Ray worker:
    ``eval.ray_sweep``): one shared prefill, then every cell forked from it. ``cm``: any ``CompressedModel`` of
    the model."""

    def __init__(self, cm: CompressedModel, tokenizer, cells: list, *, length: int, seed: int, kl: bool, model: str,
                 ledger_mass: bool = True):
        cells = [(anchors.resolve(r, tokenizer), b) for r, b in cells]  # TA's anchors as this tokenizer's ids
        self.tokenizer, self.cells, self.length, self.seed, self.kl, self.model = (
            tokenizer, cells, length, seed, kl, model)
        self.ledger_mass = ledger_mass
        self.base = shared_base(cm, cells)

    def keys(self, task: str, index: int) -> list[dict]:
        """The store key of every cell on context ``index`` of ``task``."""
        dtype = str(self.base.cache.k_pages.dtype).removeprefix("torch.")
        return cell_keys(self.cells, self.model, task, index, self.length, self.seed, dtype)

    def run_context(self, task_name: str, index: int, stored: list[bool]) -> dict:
        """Run the cells not ``stored`` (the full cell always: it is the KL reference) on one context: ``rows`` (the
        store's rows), ``answers`` {(recipe, budget): tokens}, the ``context`` and ``question`` ids, ``prefill_s``
        and ``cells_s``."""
        task = get_task(task_name)
        sample = make_sample(task, self.tokenizer, self.length, seed=self.seed, index=index)
        texts = sample.prompt(self.tokenizer)
        context, question = (encode(self.tokenizer, t) for t in texts)
        segments = task_segments(task, sample, self.tokenizer, texts[0])  # for recipes that keep steps as units
        t0 = time.perf_counter()
        self.base.reset()
        with torch.no_grad():
            self.base.prefill(ids_tensor(context, self.base.device), compress=False, logits="last", segments=segments,
                              tokenizer=self.tokenizer)
        prefill_s = time.perf_counter() - t0
        reference, answers, rows, t0 = {}, {}, [], time.perf_counter()
        for i, ((recipe, budget), key) in enumerate(zip(self.cells, self.keys(task_name, index))):
            if i == 0 or not stored[i]:
                row = _cell(self.base, recipe, budget, sample, question, self.tokenizer, task.max_new_tokens, self.kl,
                            reference, self.ledger_mass)
                if "tokens" in row:
                    answers[(recipe.name, str(budget))] = row.pop("tokens")
                rows.append(dict.fromkeys(VALUES) | key | row)
        return {"rows": rows, "answers": answers, "context": context, "question": question, "prefill_s": prefill_s,
                "cells_s": time.perf_counter() - t0}


def shared_base(cm: CompressedModel, cells: list) -> CompressedModel:
    """A full-budget model of ``cm`` that keeps, when it prefills with ``compress=False``, the queries of the widest
    observation window any of the (recipe, budget) ``cells`` reads, so each cell can fork it and compress."""
    built = [m for m in (_applied(cm, r, b) for r, b in cells) if m is not None]  # a SPECTRA cell's is calibrated
    shared = Recipe("shared-prefill", "snapkv",
                    scorer_args={"window": max([m.observation_window for m in built] + [1])})
    if any(_reads_ids(r) for r, _ in cells):  # a TA sponsoring nothing: the same, and it logs the token ids
        shared = compose("ta-fast", shared, anchors=[])
    calibrated = next((m for m in built if m.latent_moments is not None), cm)  # every fork inherits its basis
    return kvcompile.apply(calibrated, budget=1.0, recipe=shared)


def new_timing() -> dict:
    return {"shared_prefill_s": 0.0, "cells_s": 0.0, "contexts": 0, "separate_s": 0.0, "separate_contexts": 0,
            "separate_shared_s": 0.0, "separate_mismatches": 0, "cells_stored": 0}


def add_timing(timing: dict, done: dict) -> None:
    timing["shared_prefill_s"] += done["prefill_s"]
    timing["contexts"] += 1


def result(samples: list, timing: dict, cells: list, budgets, tasks, n_samples, length, seed) -> dict:
    """What ``run`` returns, from the rows every context gave."""
    timing["cells_s"] = sum(s["wall_s"] for s in samples)
    if timing["separate_contexts"]:
        timing["shared_over_separate"] = timing["separate_shared_s"] / timing["separate_s"]
    budgets = dict.fromkeys(str(b) for _, b in cells[1:]) if budgets is None else budgets
    config = {"recipes": list(dict.fromkeys(r.name for r, _ in cells)), "budgets": [str(b) for b in budgets],
              "tasks": tasks, "n_samples": n_samples, "length": length, "seed": seed, "query_aware": False,
              "recipe_tags": {r.name: r.tag for r, _ in cells},
              "recipe_provenance": {r.name: r.provenance for r, _ in cells}}
    return {"rows": report.cells(samples), "samples": samples, "timing": timing, "config": config}


def _cell(base, recipe, budget, sample, question, tokenizer, max_new_tokens, kl, reference, mass=True) -> dict:
    """One cell on one context: fork the shared cache, compress, answer; the store's value columns plus the
    answer's ``tokens``. ``reference`` keeps the first cell's (the full cell's) answer and logits for KL; ``mass``:
    measure the ledger's dropped mass."""
    t0 = time.perf_counter()
    try:
        model = base.fork(recipe, budget)
        before = None if budget.is_full else model.fork()  # uncompressed: the UOR and the ledger's dropped mass
        model.compress()
        stats = model.cache_stats()
        share = stats["tokens_held"] / (int(model.seen.sum()) * model.spec.num_layers * model.spec.num_kv_heads)
        probe = model.fork() if kl else None
        tokens = answer(model, tokenizer, read_question(model, question), max_new_tokens)
        row = {"wall_s": time.perf_counter() - t0, "tokens": tokens, "query_aware": False,  # question read after
               "score": sample.score(tokenizer.decode(tokens, skip_special_tokens=True)),
               "bytes_held": stats["bytes_held"], "bytes_allocated": stats["bytes_allocated"],
               "bytes_full": stats["bytes_full"]}
        bounded = _bounded(before, model) if before is not None and mass else None  # not timed, nor the UOR
        row["ledger"] = ledger.dumps(ledger.ledger(stats, budget, bounded))
        if before is not None and recipe.scorer:  # at the share of the context's tokens the cell kept
            row["uor"] = held_uor(before, share)[0]
        ids = reference.setdefault("ids", question + tokens)
        if kl:
            with torch.no_grad():
                logits = probe.prefill(ids_tensor(ids, probe.device), compress=False)[0, :-1]
            s = summarize([next_token_metrics(reference.setdefault("logits", logits), logits, torch.tensor(ids[1:]))])
            row.update(kl_mean=s["kl_mean"], kl_p99=s["kl_p99"], top1=s["top1"], kl_tokens=s["scored_tokens"])
        return row
    except Exception as e:  # noqa: BLE001 - a failing recipe is a result, not the end of the sweep
        return {"wall_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}


def _bounded(before, model) -> dict:
    """The ledger's dropped mass, or the error that stopped it (the cell's own result stands either way)."""
    try:
        return ledger.dropped_mass(before, model)
    except Exception as e:  # noqa: BLE001 - recorded in the ledger
        return {"error": f"{type(e).__name__}: {e}"}


def _applied(cm: CompressedModel, recipe, budget) -> CompressedModel | None:
    """A cell's model; None for a cell that cannot be built (its error is recorded when it runs)."""
    try:
        return kvcompile.apply(cm, budget=budget, recipe=recipe)
    except ValueError:
        return None


def _reads_ids(recipe) -> bool:
    """Whether a cell reads the context's token ids (``ContextTokens``); False for one that cannot be built yet (bad
    parameters, or learned weights not trained yet: ``kvcompile train``)."""
    try:
        scorer, _ = recipe.build()
    except (ValueError, FileNotFoundError):
        return False
    return scorer is not None and observation.keeps_ids(scorer.sources())


def _separate(base, cells, context, question, tokenizer, max_new_tokens, answers, timing) -> None:
    """Time every cell as its own prefill + compress + decode from an empty cache (making the model is not timed)
    and count answers that differ from the shared-prefill ones."""
    for recipe, budget in cells:
        if (recipe.name, str(budget)) not in answers:  # failed in the shared run: its error is already recorded
            continue
        model = base.fork(recipe, budget)  # same programs as a re-targeted apply(), without rewriting them
        model.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.prefill(ids_tensor(context, model.device), logits="last")
        tokens = answer(model, tokenizer, read_question(model, question), max_new_tokens)
        timing["separate_s"] += time.perf_counter() - t0
        timing["separate_mismatches"] += int(tokens != answers.get((recipe.name, str(budget))))
    timing["separate_contexts"] += 1


def markdown(result: dict, model: str = "") -> str:
    """The table as Markdown: one row per (task, recipe, budget), then the shared-prefill timing."""
    cfg, t = result["config"], result["timing"]
    lines = [f"{model} @ {cfg['length']} tokens, {cfg['n_samples']} samples per task, seed {cfg['seed']}, "
             "query-agnostic (context compressed before the question is read). Bytes: K/V pages held per request "
             "after compressing the context; UOR: the scorer's union-overhead ratio at the share it kept; wall: "
             "seconds per cell (compress + answer, all samples), the shared prefill excluded.", "",
             *report.table(result["rows"])]
    lines += ["", f"Shared prefill: {t['shared_prefill_s']:.1f} s for {t['contexts']} contexts, cells "
              f"{t['cells_s']:.1f} s."]
    if t.get("separate_contexts"):
        lines.append(f"On {t['separate_contexts']} context(s) every cell was also run separately: shared "
                     f"{t['separate_shared_s']:.1f} s vs separate {t['separate_s']:.1f} s (ratio "
                     f"{t['shared_over_separate']:.3f}); answers that differ: {t['separate_mismatches']}.")
    return "\n".join(lines) + "\n"


def write(result: dict, out: str | Path, model: str = "") -> list[Path]:
    """``out``.csv, ``out``.json, ``out``.md and ``out``.png (score against bytes held, one panel per task, one
    line per recipe; left out when matplotlib is not installed)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".csv").write_text(report.csv_text(result["rows"]))
    out.with_suffix(".json").write_text(json.dumps({**result, "model": model}, indent=1))
    out.with_suffix(".md").write_text(markdown(result, model))
    cfg = result["config"]
    title = f"{model} @ {cfg['length']} tokens, {cfg['n_samples']} samples per task (query-agnostic)"
    png = report.plot(result["rows"], out.with_suffix(".png"), title)
    return [out.with_suffix(s) for s in (".csv", ".json", ".md")] + ([png] if png else [])
