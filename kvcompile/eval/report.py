"""Tables and plots of per-sample result rows (the store's, or a sweep's own): one line per cell.

A cell is (model, length, format, task, recipe, version, fingerprint, budget); its samples (all seeds) are
aggregated by ``cells``: mean score and bytes over the samples that succeeded, wall time summed, KL mean and top-1
weighted by scored tokens (equal to pooling the tokens), KL p99 the largest per-sample p99 (an upper bound of the
pooled one), the last error.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

GROUP = ("model", "length", "format", "task", "recipe", "version", "fingerprint", "budget")
COLUMNS = [*GROUP, "provenance", "n", "score", "bytes_held_mean", "bytes_allocated_mean",
           "bytes_full_mean", "held_fraction", "uor", "wall_s", "kl_mean", "kl_p99", "top1", "query_aware", "error"]
_HEADER = ("| task | recipe | fingerprint | provenance | budget | n | score | KiB held | held / full | UOR | wall s "
           "| KL mean | KL p99 | top-1 | query-aware | error |")


def cells(rows: list[dict]) -> list[dict]:
    """Per-sample rows (``store.KEY`` and ``store.VALUES`` columns) -> one dict per cell, with ``COLUMNS``, in
    the order the cells first appear."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in GROUP), []).append(row)
    return [_aggregate(dict(zip(GROUP, key)), samples) for key, samples in groups.items()]


def _aggregate(cell: dict, samples: list[dict]) -> dict:
    ok = [s for s in samples if s["error"] is None]
    errors = [s["error"] for s in samples if s["error"] is not None]
    aware = [s["query_aware"] for s in ok if s["query_aware"] is not None]
    p99 = [s["kl_p99"] for s in ok if s["kl_p99"] is not None]
    cell.update(provenance=samples[-1]["provenance"], n=len(ok), score=_mean(ok, "score"),
                bytes_held_mean=_mean(ok, "bytes_held"), bytes_allocated_mean=_mean(ok, "bytes_allocated"),
                bytes_full_mean=_mean(ok, "bytes_full"), uor=_mean(ok, "uor"),
                wall_s=sum(s["wall_s"] or 0.0 for s in samples),
                kl_mean=_mean(ok, "kl_mean", "kl_tokens"), top1=_mean(ok, "top1", "kl_tokens"),
                kl_p99=max(p99) if p99 else None, query_aware=any(aware) if aware else None,
                error=errors[-1] if errors else None)
    held, full = cell["bytes_held_mean"], cell["bytes_full_mean"]
    cell["held_fraction"] = held / full if held is not None and full else None
    return {c: cell[c] for c in COLUMNS}


def _mean(samples: list[dict], col: str, weight: str | None = None) -> float | None:
    """Mean of ``col`` over the samples that have it (a writer may leave columns out), weighted by ``weight``."""
    pairs = [(s[col], s[weight] or 1 if weight else 1) for s in samples if s[col] is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if pairs else None


def table(cells: list[dict]) -> list[str]:
    """Markdown lines: the header and one line per cell."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [_HEADER, "|" + "---|" * _HEADER.count(" | ") + "---|"]
    for c in cells:
        kib = None if c["bytes_held_mean"] is None else c["bytes_held_mean"] / 1024
        aware = "-" if c["query_aware"] is None else "yes" if c["query_aware"] else "no"
        lines.append(f"| {c['task']} | {c['recipe']}@{c['version']} | {c['fingerprint']} | {c['provenance']} | "
                     f"{c['budget']} | {c['n']} | {fmt(c['score'], '.2f')} | {fmt(kib, '.0f')} | "
                     f"{fmt(c['held_fraction'], '.3f')} | {fmt(c['uor'], '.2f')} | {c['wall_s']:.1f} | "
                     f"{fmt(c['kl_mean'], '.3f')} | "
                     f"{fmt(c['kl_p99'], '.2f')} | {fmt(c['top1'], '.2f')} | {aware} | {c['error'] or ''} |")
    return lines


def markdown(rows: list[dict]) -> str:
    """One section per (model, length, format), the cells in the order they were first stored."""
    out = []
    for (model, length, form), part in _sections(cells(rows)).items():
        seeds = sorted({r["seed"] for r in rows if (r["model"], r["length"], r["format"]) == (model, length, form)})
        out += [f"## {model} @ {length} tokens, {form}", "",
                f"Seeds {', '.join(map(str, seeds))}; n: samples that succeeded. Bytes: K/V pages held per "
                "request after compressing the context; wall: seconds per cell (all samples; a sweep's shared "
                "prefill excluded, lm-eval's prefills included).",
                "", *table(part), ""]
    return "\n".join(out)


def csv_text(cells: list[dict], columns: list[str] = COLUMNS) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(cells)
    return out.getvalue()


def _sections(cells: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for c in cells:
        out.setdefault((c["model"], c["length"], c["format"]), []).append(c)
    return out


def plot(cells: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Score against bytes held: one row of panels per (model, length, format), one panel per task, one line per
    recipe. None (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sections, tasks = _sections(cells), list(dict.fromkeys(c["task"] for c in cells))
    fig, axes = plt.subplots(len(sections), len(tasks), figsize=(5 * len(tasks), 4 * len(sections)), squeeze=False)
    for ax_row, ((model, length, form), part) in zip(axes, sections.items()):
        for ax, task in zip(ax_row, tasks):
            done = [c for c in part if c["task"] == task and c["score"] is not None]
            lines = dict.fromkeys((c["recipe"], c["version"], c["fingerprint"]) for c in done)
            tags = [f"{r}@{v}" for r, v, _ in lines]
            for k, (recipe, version, fp) in enumerate(lines):
                label = f"{recipe}@{version}" + (f" {fp[:6]}" if tags.count(f"{recipe}@{version}") > 1 else "")
                pts = sorted((c["bytes_held_mean"] / 2**20, c["score"]) for c in done
                             if (c["recipe"], c["version"], c["fingerprint"]) == (recipe, version, fp))
                style = dict(marker="*", markersize=12) if recipe == "full" else dict(  # overlaps stay visible
                    marker="osD^vP<>"[k % 8], markersize=max(12 - 1.5 * k, 4), fillstyle="none",
                    linestyle="-:--"[k % 3])
                ax.plot(*zip(*pts), label=label, **style)
            ax.set_title(f"{task}" if len(sections) == 1 else f"{task}: {model} @ {length}, {form}")
            ax.set_xlabel("KV bytes held per request (MiB)")
            ax.set_ylabel("score")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        ax_row[-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
