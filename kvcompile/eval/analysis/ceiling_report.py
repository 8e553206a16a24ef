"""The ceiling on a real model: sample rows (``rows``), analyse them (``ceiling.analyse``), summarise per budget,
and write a table (markdown + JSON) and a figure in the shape of the paper's Table 1 / Figure 1.

Per row: relative residual ``r = |o - o_S| / |o|``; closure share ``rho = (E(T_s) - E(S)) / E(T_s)`` (0 when
top-mass is exact); the certificate ``kappa = E(T_s) / bound``, infinite where the bound is 0, and it certifies
``rho <= 1 - 1/kappa`` for the best subset of the candidates. Medians over rows, as the paper reports them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import ceiling
from .rows import attention_rows

PAPER = ("arXiv 2608.25230 (abstract): the exact best subset closes a median 2-5% of top-mass's gap; "
         "the balancing selector sits at the floor")


def run(cm, tokenizer, *, rows: int = 480, contexts: int = 2, length: int = 1024, window: int = 64,
        budgets=ceiling.BUDGETS, max_swaps: int = 16, batch: int = 16, seed: int = 0, progress: bool = True) -> dict:
    """Analyse about ``rows`` attention rows of ``cm`` (any ``CompressedModel``; its cache is never written);
    returns ``{"summary": [per budget], "per_layer": ..., "config": ..., "timing": ...}``."""
    start, analysis_s, o2, layers, per_row = time.perf_counter(), 0.0, [], [], {}
    bar = tqdm(total=contexts * cm.spec.num_layers, disable=not progress, desc="ceiling")
    source = attention_rows(cm, tokenizer, rows=rows, contexts=contexts, length=length, window=window,
                            min_keys=2 * max(budgets), seed=seed)
    for part in source:
        t0 = time.perf_counter()
        for a, V in zip(part["a"].split(batch), part["V"].split(batch)):
            out = ceiling.analyse(a, V, budgets, max_swaps=max_swaps)
            o2.append(out.pop("o2"))
            for s, entry in out.items():
                for key, value in entry.items():
                    per_row.setdefault(s, {}).setdefault(key, []).append(value)
        layers.append(torch.full((len(part["a"]),), part["layer"]))
        analysis_s += time.perf_counter() - t0
        bar.update(1)
    bar.close()
    cat = {s: {k: torch.cat(v) if torch.is_tensor(v[0]) else v[0] for k, v in d.items()} for s, d in per_row.items()}
    o2, layer = torch.cat(o2), torch.cat(layers)
    of_layer = lambda d, i: {k: v[layer == i] if torch.is_tensor(v) else v for k, v in d.items()}  # noqa: E731
    return {
        "summary": [summarise(s, d, o2) for s, d in cat.items()],
        "per_layer": {int(i): [summarise(s, of_layer(d, i), o2[layer == i]) for s, d in cat.items()]
                      for i in layer.unique()},
        "config": {"rows": int(len(o2)), "contexts": contexts, "length": length, "window": window,
                   "budgets": list(budgets), "max_swaps": max_swaps, "seed": seed},
        "timing": {"total_s": time.perf_counter() - start, "analysis_s": analysis_s},
    }


def _median(x: torch.Tensor) -> float | None:
    x = x[~x.isnan()]
    return float(x.median()) if len(x) else None


def _quartiles(x: torch.Tensor) -> list[float] | None:
    x = x[~x.isnan()]
    return [float(v) for v in x.quantile(torch.tensor([0.25, 0.75], dtype=x.dtype))] if len(x) else None


def summarise(s: int, d: dict, o2: torch.Tensor) -> dict:
    """One budget's medians (and quartiles of the closure shares) over its rows."""
    closure = lambda e: torch.where(d["top"] > 0, (d["top"] - e) / d["top"], torch.zeros_like(e))  # noqa: E731
    residual = lambda e: (e / o2).sqrt()  # noqa: E731
    kappa = d["top"] / d["bound"]
    exact = not bool(d["exact"].isnan().all())
    reaches = (d["balancing"] <= d["exact"] * (1 + 1e-6)).double().mean()
    return {
        "s": s, "rows": int(len(o2)), "candidates": d["candidates"], "exact": exact,
        "r_top": _median(residual(d["top"])), "r_exact": _median(residual(d["exact"])),
        "r_balancing": _median(residual(d["balancing"])),
        "closure_exact": _median(closure(d["exact"])), "closure_exact_iqr": _quartiles(closure(d["exact"])),
        "closure_balancing": _median(closure(d["balancing"])),
        "closure_balancing_iqr": _quartiles(closure(d["balancing"])),
        "balancing_reaches_exact": float(reaches) if exact else None,
        "drop_top": _median(d["drop_top"]), "drop_exact": _median(d["drop_exact"]),
        "drop_balancing": _median(d["drop_balancing"]),
        "kappa_exact": _median(d["top"] / d["exact"]),
        "bound_positive": float((d["bound"] > 0).double().mean()),
        "kappa_bound": float(kappa.median()) if bool(kappa.median().isfinite()) else None,  # None: infinite
        "certified_5pct": float((kappa <= 1 / 0.95).double().mean()),
        "converged": float(d["converged"].double().mean()),
    }


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict, model: str, command: str) -> str:
    cfg, t = result["config"], result["timing"]
    lines = [
        f"# Ceiling analysis: {model} (ABSTRACT-ONLY / INFERRED)", "",
        f"```bash\n{command}\n```", "",
        f"{cfg['rows']} attention rows ({cfg['contexts']} prose windows of {cfg['length']} tokens, the last "
        f"{cfg['window']} queries, every layer and query head); {t['total_s']:.0f} s in all, {t['analysis_s']:.0f} s "
        f"analysing. Medians over rows. `c`: candidates (the heaviest keys); `best`: the exact best subset of them "
        f"(s <= 8 only); balancing: over all keys, at most {cfg['max_swaps']} swaps (`conv`: rows that settled). "
        f"ρ: closure share of top-mass's gap (E); κ exact = E(top)/E(best); κ bound = E(top)/bound (∞ where "
        f"the bound is 0), which proves ρ ≤ 1 − 1/κ for the best subset of the c candidates; `ρ≤5%`: rows where "
        f"it proves ρ ≤ 0.05. Dense: r = 0.", "",
        "| s | c | r top-mass | r best | r balancing | ρ best [IQR] | ρ balancing [IQR] | bal. ≤ best | "
        "dropped top / best / bal. | κ exact | κ bound | ρ≤5% | conv |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        iqr = lambda q: f" [{q[0]:.2f}, {q[1]:.2f}]" if q else ""  # noqa: E731
        lines.append(
            f"| {r['s']} | {r['candidates']} | {_fmt(r['r_top'])} | {_fmt(r['r_exact'])} | {_fmt(r['r_balancing'])} "
            f"| {_fmt(r['closure_exact'])}{iqr(r['closure_exact_iqr'])} | {_fmt(r['closure_balancing'])}"
            f"{iqr(r['closure_balancing_iqr'])} | {_fmt(r['balancing_reaches_exact'], '.2f')} | "
            f"{_fmt(r['drop_top'])} / {_fmt(r['drop_exact'])} / {_fmt(r['drop_balancing'])} | "
            f"{_fmt(r['kappa_exact'], '.2f')} | {_fmt(r['kappa_bound'], '.3g') if r['kappa_bound'] else '∞'} | "
            f"{r['certified_5pct']:.2f} | {r['converged']:.2f} |")
    return "\n".join(lines + ["", f"Paper: {PAPER}.", ""])


def plot(result: dict, model: str, path: Path) -> None:
    """Residual against budget (left) and closure share against budget (right), medians with quartiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    s = [r["s"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("r_top", "top-mass", "o-"), ("r_exact", "best subset (exact, s <= 8)", "s--"),
                              ("r_balancing", "balancing", "^:")):
        pts = [(x, r[key]) for x, r in zip(s, rows) if r[key] is not None]
        left.plot(*zip(*pts), style, label=label)
    left.set(xscale="log", yscale="log", xlabel="kept keys s", ylabel="median |o - o_S| / |o|  (dense: 0)")
    for key, label, style in (("closure_exact", "best subset (exact)", "s-"), ("closure_balancing", "balancing", "^:")):
        pts = [(x, r[key], r[key + "_iqr"]) for x, r in zip(s, rows) if r[key] is not None]
        x, y, q = zip(*pts)
        right.errorbar(x, y, yerr=[[m - lo for m, (lo, _) in zip(y, q)], [hi - m for m, (_, hi) in zip(y, q)]],
                       fmt=style, capsize=3, label=label)
    right.axhspan(0.02, 0.05, color="grey", alpha=0.3, label="paper: 2-5%")
    right.set(xscale="log", xlabel="kept keys s", ylabel="closure share of top-mass's gap (median, IQR)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}: {result['config']['rows']} attention rows, keep-and-renormalise (inferred)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out: str | Path, model: str, command: str) -> list[Path]:
    """``out``.json, ``out``.md and ``out``.png."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": model, "command": command, **result}, indent=1))
    out.with_suffix(".md").write_text(markdown(result, model, command))
    plot(result, model, out.with_suffix(".png"))
    return [out.with_suffix(x) for x in (".json", ".md", ".png")]
