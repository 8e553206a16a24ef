"""LU-KV with a curve calibrated on this model against its base scorer (Expected Attention, epsilon 0.02) at equal
bytes: uniform per-head budgets, Ada-KV's score-pooled budgets, and the curve's static per-head budgets. The curve
comes from ``calibration.lukv`` on offline prose windows (``eval.fidelity.prose_windows``: context, then the
``--future`` tokens whose attention defines a head's utility). Cells run through ``kvcompile.eval.sweep`` with
next-token KL against the full cache, query-agnostic.

    python bench/lukv.py --samples 8 --length 1024 --budgets 0.25,0.1

Writes ``bench/results/lukv/lukv.{csv,json,md,png}``; the curve is saved in the JSON (``curve``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from record import Results

import kvcompile
from kvcompile.calibration.lukv import calibrate
from kvcompile.eval import sweep
from kvcompile.eval.fidelity import prose_windows
from kvcompile.recipes import get_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--tasks", default="niah_single_1,passkey")
    ap.add_argument("--calibration", type=int, default=8, help="prose windows to calibrate on")
    ap.add_argument("--future", type=int, default=128, help="tokens after each window's context whose attention "
                                                            "is a head's utility")
    args = ap.parse_args()
    results = Results("lukv")
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    lukv = get_recipe("lukv")
    start = time.perf_counter()
    windows = prose_windows(tok, args.calibration, 512 + args.future)
    curve = calibrate(cm, [torch.tensor([w]) for w in windows], scorer=lukv.scorer, scorer_args=lukv.scorer_args,
                      future=args.future)
    print(f"curve calibrated on {args.calibration} windows of {512 + args.future} tokens in "
          f"{time.perf_counter() - start:.1f} s")
    calibrated = dataclasses.replace(lukv, name="lukv-calibrated", allocator_args={"curve": curve})
    uniform = dataclasses.replace(lukv, name="expected-attention-eps0.02", allocator="uniform")
    adakv = dataclasses.replace(lukv, name="adakv-expected-attention-eps0.02", allocator="adakv",
                                allocator_args={"alpha_safeguard": 0.2})
    budgets = [sweep.parse_budget(b) for b in args.budgets.split(",")]
    result = sweep.run(cm, tok, [uniform, adakv, calibrated], budgets, args.tasks.split(","),
                       n_samples=args.samples, length=args.length, kl=True, model="smollm2-135m")
    result["curve"] = curve
    for path in results.adopt(sweep.write(result, results.stem, model="smollm2-135m")):
        print(path)


if __name__ == "__main__":
    main()
