"""Answer-evidence gap (issue 20 item 5; INFERRED: the paper was not found; this is the
description's answer-chain consistency, without its fixed-trace replay and perturbation parts).

The task carries a fixed supporting chain: ``VAR A = 52817. VAR B = VAR A. VAR C = VAR B. ...`` (``hops``
copies), spread through filler with a distractor chain of other names and another value, and asks for the value of
the chain's last variable: a right answer needs the chain, not just a number of the text. Per (recipe, budget) and
sample, the document is compressed before the question is read (the library's default), then:

- *answer*: the value asked for (string match);
- *chain retained*: per fact (one assignment), the share of its tokens every (layer, KV head) holds
  (``CompressedModel.held_positions``); the table gives the chain's mean and its weakest fact's;
- *chain restated*: one probe per fact, each read on its own fork of the compressed cache, "which variable is VAR C
  assigned from?" (the root: "what value is VAR A assigned?"); the chain is consistent when every probe names the
  fact's source;
- *gap*: accuracy minus the accuracy of rows whose restated chain is also consistent (points): answers the
  compressed model gets right without the chain that supports them.
"""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ...model import CompressedModel
from ..decoding import answer, encode, ids_tensor, read_question
from ..samples import Sample, Task, string_match_all
from ..sweep import grid, shared_base
from ..synthetic import _FILLER, make_sample
from . import diagnose, masked, tables

HOPS = 3
SLACK = 4  # probe answers decode their reference's tokens plus this many


@dataclass
class ChainSample(Sample):
    """A chain task's sample: ``facts`` the chain's statements (root first), ``probes`` (question, answer prefix,
    reference) one per fact."""

    facts: tuple[str, ...] = ()
    probes: tuple[tuple[str, str, str], ...] = ()


def _names(rng: random.Random, k: int) -> list[str]:
    names: list[str] = []
    while len(names) < k:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names.append(name) if name not in names else None
    return names


def chain_task(hops: int = HOPS) -> Task:
    """The chain task with ``hops`` copies after the root assignment; ``n`` filler lines."""
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"hops must be a positive int, got {hops!r}")

    def build(rng: random.Random, n: int) -> ChainSample:
        names = _names(rng, 2 * (hops + 1))
        value, other = (str(v) for v in rng.sample(range(10000, 99999), 2))
        chains = [[f"VAR {c[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(c, c[1:])]
                  for c, v in ((names[:hops + 1], value), (names[hops + 1:], other))]
        units = [_FILLER] * n
        for stmts in chains:  # each chain in order, at sorted depths
            depths = sorted(rng.random() for _ in stmts)
            for stmt, depth in reversed(list(zip(stmts, depths))):
                units.insert(round(depth * n), stmt)
        context = ("Memorize and track the chains of variable assignment hidden in the following text.\n\n"
                   + " ".join(units))
        last, chain = names[hops], names[:hops + 1]
        probes = [(f"\nQuestion: What value is VAR {chain[0]} assigned in the text above?",
                   f"Answer: VAR {chain[0]} =", value)]
        probes += [(f"\nQuestion: Which variable is VAR {b} assigned from in the text above?",
                    f"Answer: VAR {b} = VAR", a) for a, b in zip(chain, chain[1:])]
        return ChainSample(context, f"\nQuestion: What is the value of VAR {last} in the text above?", (value,),
                           f"Answer: VAR {last} =", facts=tuple(chains[0]), probes=tuple(probes))

    return Task(f"chain{hops}", build, 12)


def _generate(model, tokenizer, question: list[int], reference: str) -> float:
    """Whether ``model`` (consumed) answers ``question`` with ``reference``."""
    limit = len(encode(tokenizer, " " + reference)) + SLACK
    tokens = answer(model, tokenizer, read_question(model, question), limit)
    return string_match_all((reference,), tokenizer.decode(tokens, skip_special_tokens=True))


class Prompt:
    """One chain sample's ids: context, question, each probe's question and reference, each fact's positions."""

    def __init__(self, sample: ChainSample, tokenizer):
        context, self.question = (encode(tokenizer, t) for t in sample.prompt(tokenizer))
        self.context_ids, self.sample = context, sample
        text = sample.prompt(tokenizer)[0]
        self.fact_positions = [diagnose.evidence_positions(tokenizer, text, [f.rstrip(".")]) for f in sample.facts]
        self.probes = [(encode(tokenizer, Sample(sample.context, q, (ref,), prefix).prompt(tokenizer)[1]), ref)
                       for q, prefix, ref in sample.probes]


@torch.no_grad()
def cell_row(model: CompressedModel, prompt: Prompt, tokenizer) -> dict:
    """One cell's measures on ``model`` (its document compressed; not consumed)."""
    keep = masked.kept(model.held_positions(), len(prompt.context_ids))
    facts = [float(diagnose.coverage(keep, pos).mean()) for pos in prompt.fact_positions]
    correct = _generate(model.fork(), tokenizer, prompt.question, prompt.sample.answers[0])
    probes = [_generate(model.fork(), tokenizer, q, ref) for q, ref in prompt.probes]
    return {"score": correct, "chain_coverage": sum(facts) / len(facts), "weakest_fact": min(facts),
            "facts": facts, "probes": probes, "consistent": float(all(p == 1 for p in probes)),
            "grounded": float(correct == 1 and all(p == 1 for p in probes)),
            "bytes_held": model.cache_stats()["bytes_held"]}


def run(cm: CompressedModel, tokenizer, recipes: list, budgets: list, *, n_samples: int = 10, length: int = 1024,
        hops: int = HOPS, seed: int = 0, progress: bool = True) -> dict:
    """Every (recipe, budget) and the full cache on ``n_samples`` chain samples; returns ``{"samples", "summary",
    "config", "timing"}``."""
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    start, task, cells = time.perf_counter(), chain_task(hops), grid(recipes, budgets)
    base, samples = shared_base(cm, cells), []
    for index in tqdm(range(n_samples), disable=not progress, desc="answer-evidence gap"):
        prompt = Prompt(make_sample(task, tokenizer, length, seed=seed, index=index), tokenizer)
        base.reset()
        with torch.no_grad():
            base.prefill(ids_tensor(prompt.context_ids, base.device), compress=False, logits="last")
        for recipe, budget in cells:
            t0 = time.perf_counter()
            row = {"task": task.name, "sample": index, "recipe": recipe.tag, "budget": str(budget)}
            try:
                model = base.fork(recipe, budget)
                model.compress()
                row.update(cell_row(model, prompt, tokenizer))
            except Exception as e:  # noqa: BLE001 - a failing cell is a result, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"
            samples.append(row | {"wall_s": time.perf_counter() - t0})
    summary = tables.means(samples, ("task", "recipe", "budget"), ("score", "consistent", "grounded",
                                                                   "chain_coverage", "weakest_fact", "bytes_held",
                                                                   "wall_s"))
    for row in summary:
        row["gap"] = None if row["score"] is None else 100 * (row["score"] - row["grounded"])
    return {"samples": samples, "summary": summary,
            "config": {"recipes": [r.tag for r, _ in cells], "budgets": [str(b) for b in budgets], "task": task.name,
                       "hops": hops, "n_samples": n_samples, "length": length, "seed": seed},
            "timing": {"total_s": time.perf_counter() - start}}


COLUMNS = [("recipe", "s"), ("budget", "s"), ("n", "d"), ("score", ".2f"), ("consistent", ".2f"), ("grounded", ".2f"),
           ("gap", "+.0f"), ("chain_coverage", ".2f"), ("weakest_fact", ".2f"), ("bytes_held", "kib")]


def markdown(result: dict, model: str, command: str) -> str:
    cfg, t = result["config"], result["timing"]
    return "\n".join([
        f"# Answer-evidence gap: {model} (INFERRED: paper not found)", "",
        f"```bash\n{command}\n```", "",
        f"{cfg['n_samples']} samples of a {cfg['hops']}-hop chain ({cfg['hops'] + 1} facts, one distractor chain) at "
        f"{cfg['length']} tokens, seed {cfg['seed']}; {t['total_s']:.0f} s in all (2 shared CPU cores, under "
        "contention). Score: the chain's value asked for; consistent: every fact restated by its own probe; "
        "grounded: right answer and consistent chain; gap: score minus grounded, in points; chain coverage / weakest "
        "fact: share of the chain's (of its least-held fact's) tokens held, mean over layers and KV heads; KiB: the "
        "document's K/V pages held.", "", *tables.markdown(result["summary"], COLUMNS), ""])
