"""KVzap's surrogates against KVzip's scores on the held-out contexts of a ``kvcompile train kvzap`` run: Spearman
per (layer, KV head), averaged, for the trained weights, the same surrogate at its random initialisation, and two
one-feature baselines read from the same features (KNorm's -||k|| and ||v||).

    kvcompile train kvzap --model smollm2-135m --run-dir /tmp/kvzap-run --out kvcompile/weights
    python bench/kvzap.py --run-dir /tmp/kvzap-run --weights kvcompile/weights/kvzap-smollm2-135m.safetensors \
        [--weights other.safetensors ...]

Writes ``bench/results/kvzap/kvzap_spearman.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from record import Results
from safetensors.torch import load_file

from kvcompile.methods.kvzap import Surrogate
from kvcompile.train.kvzap import spearman, surrogate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, help="the training run's folder (holds data.safetensors)")
    ap.add_argument("--weights", action="append", required=True, help="trained .safetensors files (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed (the random initialisation)")
    args = ap.parse_args()
    results = Results("kvzap", name="kvzap_spearman")
    data = load_file(str(Path(args.run_dir) / "data.safetensors"))
    x, y, hx, hy = data["x"], data["y"], data["held_x"], data["held_y"]
    rows = []
    with torch.no_grad():
        for path in args.weights:
            card = json.loads(Path(path).with_suffix(".json").read_text())
            net = Surrogate.from_tensors(load_file(path))
            hidden = net.w1.shape[-1] if hasattr(net, "w1") else 0
            rows.append({"scorer": f"kvzap {card['form']} (trained)", "spearman": spearman(net(hx), hy),
                         "steps": card["schedule"]["steps"], "tokens_seen": card["tokens_seen"]})
            initial = surrogate(x, y, hidden, args.seed)
            rows.append({"scorer": f"kvzap {card['form']} (random init)", "spearman": spearman(initial(hx), hy),
                         "steps": 0, "tokens_seen": 0})
        rows.append({"scorer": "−‖k‖ (knorm)", "spearman": spearman(-hx[..., -2], hy), "steps": 0, "tokens_seen": 0})
        rows.append({"scorer": "‖v‖", "spearman": spearman(hx[..., -1], hy), "steps": 0, "tokens_seen": 0})
    L, H, N, _ = hx.shape
    out = {"held_out_tokens": N, "layers": L, "kv_heads": H, "rows": rows}
    results.json(out)
    lines = [f"Spearman with KVzip's scores on {N} held-out tokens (mean over {L} layers x {H} KV heads).", "",
             "| scorer | Spearman | steps | tokens seen |", "|---|---|---|---|"]
    lines += [f"| {r['scorer']} | {r['spearman']:.3f} | {r['steps']} | {r['tokens_seen']} |" for r in rows]
    results.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
