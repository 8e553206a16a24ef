"""Failure diagnosis (issue 20 item 4; KVDiagnosis, INFERRED: the paper was not found, so the
selection, diagnostics and intervention below are our reading of its description).

Per (recipe, budget) and needle sample, the full cache and the compressed one answer the same prompt (the
document compressed before the question is read, the library's default). Rows are classed by outcome against the
full-cache control: **C->W** (full correct, compressed wrong), W->C, C->C, W->W (correct = score 1). For every row:

- *evidence coverage*: the evidence is the context tokens that spell the gold answer (every occurrence: the
  passkey's needle states it twice); per (layer, KV head) the share of them the compressed cache still holds
  (``CompressedModel.held_positions``);
- *likelihood drift*: mean over the gold answer's tokens of log p_full - log p_compressed, teacher-forced after
  the question.

For C->W rows, the **evidence boost**: the compressed selection as a mask over the plain model's full cache
(``masked``: the same attention as the compressed cache for recipes that do not compress while decoding), with
``log factor`` added to the logits of the held evidence entries in every layer and KV head, for every query after
the document (the question and the answer: the first answer token is predicted from the question's last query);
and the **sham**: the same bias on as many held non-evidence entries, drawn at random, in each (layer, KV head).
Answers are decoded greedily to at most the gold answer's length plus ``ANSWER_SLACK`` tokens. A row is *flipped*
when the intervention answers correctly. Recovery by the boost but not the sham points at attention allocation;
no recovery with the evidence held points elsewhere (positions, the model).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor
from tqdm import tqdm

from ...model import CompressedModel
from ..decoding import answer, encode, ids_tensor, read_question
from ..sweep import grid, shared_base
from ..synthetic import get_task, make_sample
from . import masked, tables

ANSWER_SLACK = 4  # answers decode at most the gold answer's tokens plus this many (the score is a string match)
FACTOR = 4.0  # KVDiagnosis's 4x boost, ln 4 on the logits
OUTCOMES = ("C->W", "W->C", "C->C", "W->W")
PAPER = {"boost": 0.292, "sham": 0.063}  # share of failures repaired (KVDiagnosis abstract, via the issue)


def outcome(full_score: float, score: float) -> str:
    """The row's class against the full-cache control: correct means a score of 1."""
    return ("C" if full_score == 1 else "W") + "->" + ("C" if score == 1 else "W")


def evidence_positions(tokenizer, text: str, answers) -> list[int]:
    """Positions of the tokens of ``encode(tokenizer, text)`` that overlap an occurrence of any of ``answers``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != encode(tokenizer, text):
        raise ValueError("the tokenizer's offsets do not describe the context's ids")
    spans = []
    for a in answers:
        start = text.find(a)
        while start >= 0:
            spans.append((start, start + len(a)))
            start = text.find(a, start + 1)
    return [i for i, (s, e) in enumerate(enc["offset_mapping"]) if any(s < b and a < e for a, b in spans)]


def coverage(keep: Tensor, evidence: list[int]) -> Tensor:
    """[L, Hkv] share of the ``evidence`` positions each (layer, KV head) holds; ``keep``: [L, Hkv, n]
    (``masked.kept``)."""
    if not evidence:
        raise ValueError("no evidence positions: the answer does not occur in the context")
    return keep[..., evidence].float().mean(-1)


def boosts(keep: Tensor, evidence: list[int], factor: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(boost, sham) biases [L, Hkv, n]: ``log factor`` on the held evidence entries, and on as many held
    non-evidence entries per (layer, KV head), drawn with ``generator`` (fewer only where fewer are held)."""
    if factor <= 0:
        raise ValueError(f"the boost factor must be positive, got {factor}")
    ev = torch.zeros(keep.shape[-1], dtype=torch.bool, device=keep.device)
    ev[evidence] = True
    real = keep & ev
    pool = keep & ~ev
    draw = torch.rand(keep.shape, generator=generator).to(keep.device).masked_fill(~pool, -1.0)
    order = draw.argsort(-1, descending=True).argsort(-1)  # each entry's rank in its row
    sham = pool & (order < real.sum(-1, keepdim=True))
    return math.log(factor) * real.float(), math.log(factor) * sham.float()


@torch.no_grad()
def gold_logprob(model: CompressedModel, question: list[int], gold: list[int]) -> float:
    """Mean log-probability of ``gold`` read after ``question`` over ``model``'s cache (a fork is consumed)."""
    ids = ids_tensor(question + gold[:-1], model.device)
    logp = torch.log_softmax(model.prefill(ids, compress=False, logits="all")[0, len(question) - 1:].float(), -1)
    return float(logp.gather(-1, torch.tensor(gold, device=logp.device)[:, None]).mean())


class Sample:
    """One needle prompt's pieces: ids of the context, question and gold answer, the evidence, the scorer."""

    def __init__(self, task, tokenizer, length: int, seed: int, index: int):
        sample = make_sample(task, tokenizer, length, seed=seed, index=index)
        context, question = sample.prompt(tokenizer)
        self.context, self.question = encode(tokenizer, context), encode(tokenizer, question)
        self.gold = encode(tokenizer, " " + sample.answer)
        self.evidence = evidence_positions(tokenizer, context, sample.answers)
        self.score, self.max_new = sample.score, min(task.max_new_tokens, len(self.gold) + ANSWER_SLACK)


def _answer(model, tokenizer, sample: Sample, logits) -> float:
    return sample.score(tokenizer.decode(answer(model, tokenizer, logits, sample.max_new), skip_special_tokens=True))


def _masked_score(source, plain, keep: Tensor, bias: Tensor | None, tokenizer, sample: Sample) -> float:
    reader = masked.MaskedModel(source, keep, plain, bias)
    with masked.masking(source):
        return _answer(reader, tokenizer, sample, reader.prefill(ids_tensor(sample.question, reader.device))[0, -1])


@torch.no_grad()
def sample_rows(base: CompressedModel, cells: list, sample: Sample, tokenizer, factor: float,
                generator: torch.Generator) -> list[dict]:
    """Every compressed cell's row on one sample (``base`` prefilled with its context, uncompressed)."""
    full_model = base.fork()
    full_score = _answer(full_model, tokenizer, sample, read_question(full_model, sample.question))
    full_lp = gold_logprob(base.fork(), sample.question, sample.gold)
    plain, rows, n = None, [], len(sample.context)
    for recipe, budget in cells:
        if budget.is_full:
            continue
        t0 = time.perf_counter()
        row = {"recipe": recipe.tag, "budget": str(budget), "full_score": full_score, "evidence": len(sample.evidence)}
        try:
            model = base.fork(recipe, budget)
            model.compress()
            keep = masked.kept(model.held_positions(), n)
            cov = coverage(keep, sample.evidence)
            stats = model.cache_stats()
            probe = model.fork()
            score = _answer(model, tokenizer, sample, read_question(model, sample.question))
            row.update(score=score, outcome=outcome(full_score, score), bytes_held=stats["bytes_held"],
                       coverage=float(cov.mean()), coverage_union=float(cov.amax(1).mean()),
                       coverage_min_layer=float(cov.mean(1).min()), coverage_per_head=cov.tolist(),
                       drift=full_lp - gold_logprob(probe, sample.question, sample.gold))
            if row["outcome"] == "C->W":
                plain = plain if plain is not None else masked.document(base.source, ids_tensor(sample.context,
                                                                                                base.device))
                boost, sham = boosts(keep, sample.evidence, factor, generator)
                row.update(masked_score=_masked_score(base.source, plain, keep, None, tokenizer, sample),
                           boost_score=_masked_score(base.source, plain, keep, boost, tokenizer, sample),
                           sham_score=_masked_score(base.source, plain, keep, sham, tokenizer, sample),
                           boosted=int((boost != 0).sum()), shammed=int((sham != 0).sum()))
        except Exception as e:  # noqa: BLE001 - a failing cell is a result, not the end of the run
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row | {"wall_s": time.perf_counter() - t0})
    return rows


def run(cm: CompressedModel, tokenizer, recipes: list, budgets: list, tasks: list[str], *, n_samples: int = 10,
        length: int = 1024, seed: int = 0, factor: float = FACTOR, progress: bool = True) -> dict:
    """Every (recipe, budget) on ``n_samples`` samples of each needle task; returns ``{"samples", "summary",
    "config", "timing"}``. ``cm``'s ``source`` (the plain model) runs the interventions."""
    if cm.source is None:
        raise ValueError("the intervention runs the plain model: pass a CompressedModel applied to one (not loaded)")
    start, cells = time.perf_counter(), grid(recipes, budgets)
    tables.check(tasks, n_samples)
    base, samples, generator = shared_base(cm, cells), [], torch.Generator().manual_seed(seed)
    bar = tqdm(total=len(tasks) * n_samples, disable=not progress, desc="diagnosis")
    for name in tasks:
        for index in range(n_samples):
            sample = Sample(get_task(name), tokenizer, length, seed, index)
            base.reset()
            with torch.no_grad():
                base.prefill(ids_tensor(sample.context, base.device), compress=False, logits="last")
            for row in sample_rows(base, cells, sample, tokenizer, factor, generator):
                samples.append({"task": name, "sample": index, **row})
            bar.update(1)
    bar.close()
    return {"samples": samples, "summary": summary(samples),
            "config": {"recipes": [r.tag for r, _ in cells], "budgets": [str(b) for b in budgets], "tasks": tasks,
                       "n_samples": n_samples, "length": length, "seed": seed, "factor": factor},
            "timing": {"total_s": time.perf_counter() - start}}


def summary(samples: list[dict]) -> list[dict]:
    """Per (task, recipe, budget): outcome counts, accuracies, coverage and drift on C->W and on C->C rows, and on
    C->W rows how many the masked replay, the boost and the sham answer correctly."""
    groups: dict[tuple, list[dict]] = {}
    for r in samples:
        groups.setdefault((r["task"], r["recipe"], r["budget"]), []).append(r)
    out = []
    for (task, recipe, budget), rows in groups.items():
        ok = [r for r in rows if not r.get("error")]
        by = {o: [r for r in ok if r["outcome"] == o] for o in OUTCOMES}
        row = {"task": task, "recipe": recipe, "budget": budget, "n": len(ok), "errors": len(rows) - len(ok),
               "full": _mean(ok, "full_score"), "compressed": _mean(ok, "score"),
               **{o: len(by[o]) for o in OUTCOMES}}
        for o in ("C->W", "C->C"):
            row[f"coverage {o}"] = _mean(by[o], "coverage")
            row[f"drift {o}"] = _mean(by[o], "drift")
        cw = by["C->W"]
        row["replay wrong"] = sum(r["masked_score"] != 1 for r in cw)
        row["boost flips"] = sum(r["boost_score"] == 1 for r in cw)
        row["sham flips"] = sum(r["sham_score"] == 1 for r in cw)
        row["evidence held C->W"] = sum(r["coverage"] > 0 for r in cw)
        out.append(row)
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    return sum(r[key] for r in rows) / len(rows) if rows else None


COLUMNS = [("task", "s"), ("recipe", "s"), ("budget", "s"), ("n", "d"), ("full", ".2f"), ("compressed", ".2f"),
           ("C->W", "d"), ("W->C", "d"), ("C->C", "d"), ("coverage C->W", ".2f"), ("coverage C->C", ".2f"),
           ("drift C->W", ".2f"), ("drift C->C", ".2f"), ("evidence held C->W", "d"), ("replay wrong", "d"),
           ("boost flips", "d"), ("sham flips", "d")]


def markdown(result: dict, model: str, command: str) -> str:
    rows = result["summary"]
    cw = sum(r["C->W"] for r in rows)
    boost, sham = sum(r["boost flips"] for r in rows), sum(r["sham flips"] for r in rows)
    share = (f"over all cells, the boost flips {boost} of {cw} C->W rows ({boost / cw:.1%}), the sham {sham} "
             f"({sham / cw:.1%}); paper: {PAPER['boost']:.1%} vs {PAPER['sham']:.1%}.") if cw else "no C->W rows."
    cfg, t = result["config"], result["timing"]
    explanation = (
        "Outcomes against the full-cache control (C->W: full correct, compressed wrong). Coverage: share of the "
        "answer's context tokens held, mean over layers and KV heads; drift: mean log p_full - log p_compressed of "
        "the gold answer's tokens (nats per token). On C->W rows: evidence held = rows holding any evidence token; "
        "replay wrong = the masked replay (the compressed selection over the full cache, no bias) is also wrong; "
        f"boost / sham flips = rows answered correctly with ln {cfg['factor']:g} on the held evidence entries / on "
        f"as many random held non-evidence entries per (layer, KV head): {share}")
    return "\n".join([
        f"# Failure diagnosis: {model} (KVDiagnosis, INFERRED: paper not found)", "",
        f"```bash\n{command}\n```", "",
        f"{cfg['n_samples']} samples per task at {cfg['length']} tokens, seed {cfg['seed']}; {t['total_s']:.0f} s in "
        f"all (2 shared CPU cores, under contention). {explanation}", "", *tables.markdown(rows, COLUMNS), ""])


def plot(result: dict, path) -> object | None:
    """Per cell: C->W rows, and how many the boost and the sham flip back; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["summary"]
    labels = [f"{r['task']}\n{r['recipe'].split('@')[0]}@{r['budget']}" for r in rows]
    x = torch.arange(len(rows)).float()
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows) + 4), 4.5))
    for off, key, name in ((-0.27, "C->W", "C->W rows"), (0, "boost flips", "boost flips"), (0.27, "sham flips",
                                                                                                "sham flips")):
        a.bar(x + off, [r[key] for r in rows], 0.27, label=name)
    a.set_xticks(x, labels, rotation=90, fontsize=7)
    a.set_title(f"evidence boost x{result['config']['factor']:g} vs count-matched sham")
    a.legend()
    for key, name in (("coverage C->W", "C->W"), ("coverage C->C", "C->C")):
        b.scatter(x, [r[key] if r[key] is not None else float("nan") for r in rows], label=name)
    b.set_xticks(x, labels, rotation=90, fontsize=7)
    b.set_ylim(-0.05, 1.05)
    b.set_title("evidence coverage (mean over layers, KV heads)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
