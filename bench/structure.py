"""Structure-following methods against SnapKV at equal bytes on a real model: DuoAttention with head scores
calibrated on offline prose (``calibration.duoattention``), and SimLayerKV. Cells run through
``kvcompile.eval.sweep`` (one shared prefill per context, the question read after compression) with next-token KL
against the full cache. The lazy layers found on the first pass-key context are printed before the grid; they and
the calibrated head scores are saved in the JSON (``structure``).

    python bench/structure.py --samples 10 --length 1024 --budgets 0.25,0.1 --tau 0.8

(``--tau 0.8``, the paper's Mistral value: with its default 0.9 no SmolLM2 layer is lazy on a 1k prompt.)

Writes ``bench/results/structure/structure_heads.{csv,json,md,png}``. With ``--headwise``, HeadWiseKV on
Gemma-3-270M (15 of 18 layers slide over 512 tokens) instead: windows calibrated per budget by SeqCalib on offline
prose (``calibration.headwisekv``) against the same windows all equal (StreamingLLM, uniform allocation) and SnapKV
at equal bytes, into ``bench/results/structure/structure_headwise.*``:

    python bench/structure.py --headwise --samples 3 --length 1024 --budgets 0.25,0.1 --calibration 2

Transactional Attention runs from the command line (``kvcompile eval --recipes snapkv,ta-fast+snapkv --tasks
credential,passkey``: ``bench/results/kvcompile-eval/structure_ta``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from record import Results

import kvcompile
from kvcompile.calibration import headwisekv
from kvcompile.calibration.duoattention import calibrate
from kvcompile.eval import sweep
from kvcompile.eval.fidelity import prose_windows
from kvcompile.eval.synthetic import make_sample
from kvcompile.methods.simlayerkv import lazy_mass
from kvcompile.observation import observe
from kvcompile.recipes import Recipe, get_recipe


def lazy_layers(cm, tok, length: int, recipe: Recipe) -> list[float]:
    """SimLayerKV's lazy mass of every layer on the first pass-key context (what ``tau`` is compared with)."""
    args = recipe.scorer_args
    probe = kvcompile.apply(cm, budget=1.0, recipe=Recipe("probe", "snapkv", scorer_args={"window": args["last"]}))
    context, _ = make_sample("passkey", tok, length).prompt(tok)
    with torch.no_grad():
        probe.prefill(torch.tensor([tok.encode(context, add_special_tokens=False)]), compress=False, logits="last")
    return [float(lazy_mass(observe(probe.cache, layer), args["last"], args["sinks"], args["recent"])[0])
            for layer in probe.programs.layers]


def headwise(args) -> None:
    """HeadWiseKV with SeqCalib windows (one recipe per budget) against uniform windows and SnapKV on Gemma-3."""
    out = Results("structure", name="structure_headwise")
    model, tok = kvcompile.load_model("gemma3-270m")
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    base = get_recipe("headwisekv")
    samples = [torch.tensor([w]) for w in prose_windows(tok, args.calibration, args.length)]
    budgets = [sweep.parse_budget(b) for b in args.budgets.split(",")]
    windows = headwisekv.calibrate(cm, samples, budgets, sinks=base.scorer_args["sinks"])
    results = []
    for b in budgets:
        calibrated = Recipe(f"headwisekv-seqcalib{b:g}", base.scorer, base.allocator,
                            {**base.scorer_args, "windows": [list(layer) for layer in windows[b]]},
                            source=base.source, provenance=base.provenance, inferred=base.inferred)
        results.append(sweep.run(cm, tok, ["streamingllm", calibrated, "snapkv"], [b],
                                 args.tasks.split(","), n_samples=args.samples, length=args.length, kl=True,
                                 model="gemma3-270m"))
    result = {**results[0], "rows": [row for r in results for row in r["rows"]],
              "samples": [s for r in results for s in r["samples"]],
              "timing": {k: sum(r["timing"][k] for r in results) for k in results[0]["timing"]}}
    result["structure"] = {"windows": {str(b): w for b, w in windows.items()}}
    for path in out.adopt(sweep.write(result, out.stem, model="gemma3-270m")):
        print(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--tasks", default="niah_single_1,passkey")
    ap.add_argument("--calibration", type=int, default=8, help="prose windows of 512 tokens to calibrate on")
    ap.add_argument("--tau", type=float, default=None, help="SimLayerKV's lazy threshold (default: the recipe's)")
    ap.add_argument("--headwise", action="store_true", help="HeadWiseKV on Gemma-3-270M (structure_headwise)")
    args = ap.parse_args()
    if args.headwise:
        return headwise(args)
    out = Results("structure", name="structure_heads")
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    duo = get_recipe("duoattention")
    samples = [torch.tensor([w]) for w in prose_windows(tok, args.calibration, 512)]
    scores = calibrate(cm, samples, sinks=duo.scorer_args["sinks"], recent=duo.scorer_args["recent"])
    calibrated = Recipe("duoattention-calibrated", duo.scorer, duo.allocator,
                        {**duo.scorer_args, "head_scores": [list(layer) for layer in scores]},
                        source=duo.source, provenance=duo.provenance, inferred=duo.inferred)
    simlayer = get_recipe("simlayerkv")
    if args.tau is not None:
        simlayer = dataclasses.replace(simlayer, name=f"simlayerkv-tau{args.tau:g}",
                                       scorer_args={**simlayer.scorer_args, "tau": args.tau})
    masses = lazy_layers(cm, tok, args.length, simlayer)
    lazy = [i for i, m in enumerate(masses) if m > simlayer.scorer_args["tau"]]
    print(f"lazy layers on the first pass-key context (tau {simlayer.scorer_args['tau']}): {lazy}")
    budgets = [sweep.parse_budget(b) for b in args.budgets.split(",")]
    result = sweep.run(cm, tok, ["snapkv", simlayer, calibrated], budgets, args.tasks.split(","),
                       n_samples=args.samples, length=args.length, kl=True, model="smollm2-135m")
    result["structure"] = {"head_scores": scores, "lazy_mass_first_passkey": masses, "lazy_layers": lazy}
    for path in out.adopt(sweep.write(result, out.stem, model="smollm2-135m")):
        print(path)


if __name__ == "__main__":
    main()
