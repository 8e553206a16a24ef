"""SAKI against key PCA at equal rank (docs/guide.md, page formats): top-k recall of a rank-r key index on a real
model.

The paper's protocol, on the model here: pre-RoPE query and key moments per (layer, KV head) from the model's own
prefill of some prose (``--calib`` windows), then, on other prose (``--eval`` windows), the last 512 queries of
each head score every key they may see exactly and through each index; recall = the share of the exact top-64 that
the index's top-64 recovers. Writes ``bench/results/saki/saki.{json,md,png}``.

    python bench/saki.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import time

from record import Results

import kvcompile
from kvcompile.calibration import saki as calibration
from kvcompile.eval.fidelity import calibration_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--calib", type=int, default=4, help="calibration windows of --length tokens")
    parser.add_argument("--eval", type=int, default=2, help="evaluation windows (other prose)")
    parser.add_argument("--ranks", default="8,16,32")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--out", help="path stem of what is written (default bench/results/saki/saki)")
    args = parser.parse_args()
    out = Results("saki", args.out)
    ranks = [int(r) for r in args.ranks.split(",")]

    t0 = time.perf_counter()
    model, tok = kvcompile.load_model(args.model)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    calib, held_out = calibration_windows(tok, args.calib, args.eval, args.length)
    stats = calibration.calibrate(cm, calib)
    rows = calibration.recall(cm, stats, held_out, ranks, k=args.k,
                              n_queries=args.queries)
    summary = []
    for rank in ranks:
        by = {m: {(r["layer"], r["head"]): r["recall"] for r in rows if (r["method"], r["rank"]) == (m, rank)}
              for m in ("saki", "pca")}
        saki, pca = (sum(v.values()) / len(v) for v in (by["saki"], by["pca"]))
        better = sum(by["saki"][h] > by["pca"][h] for h in by["pca"]) / len(by["pca"])
        summary.append({"rank": rank, "saki": saki, "pca": pca, "heads_improved": better,
                        "pca_error_removed": (saki - pca) / max(1 - pca, 1e-9)})
    meta = {"model": args.model, "length": args.length, "calib_windows": args.calib, "eval_windows": args.eval,
            "k": args.k, "queries": args.queries, "head_dim": cm.spec.head_dim, "seconds": time.perf_counter() - t0}
    out.json({"meta": meta, "summary": summary, "rows": rows})
    lines = [f"SAKI vs key PCA on {args.model} (head_dim {cm.spec.head_dim}): top-{args.k} recall of the last "
             f"{args.queries} queries, {args.eval} x {args.length}-token prose windows, moments from {args.calib} "
             "other windows (pre-RoPE, per KV head; a GQA group's queries pooled).", "",
             "| rank | SAKI recall | PCA recall | heads SAKI improves | PCA's remaining error removed |",
             "|---|---|---|---|---|"]
    lines += [f"| {s['rank']} | {s['saki']:.3f} | {s['pca']:.3f} | {s['heads_improved']:.0%} | "
              f"{s['pca_error_removed']:.0%} |" for s in summary]
    out.markdown("\n".join(lines))
    print("\n".join(lines))
    out.figure(_plot(rows, ranks, cm.spec.num_layers))


def _plot(rows, ranks, n_layers: int):
    """Mean recall per layer, one line per (method, rank): where in depth the two indexes differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for rank, colour in zip(ranks, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for method, style in (("saki", "-"), ("pca", "--")):
            per_layer = [[r["recall"] for r in rows if (r["method"], r["rank"], r["layer"]) == (method, rank, layer)]
                         for layer in range(n_layers)]
            ax.plot(range(n_layers), [sum(v) / len(v) for v in per_layer], style, color=colour,
                    label=f"{method} r={rank}")
    ax.set_xlabel("layer")
    ax.set_ylabel("top-k recall")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
