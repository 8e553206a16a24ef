"""SPECTRA's codec against the integer page formats at equal bytes per stored row (docs/guide.md, page formats), on
a real model.

Moments of each (layer, KV head)'s keys (before RoPE) and values come from the model's own prefill of some prose
(``--calib`` windows); on other prose (``--eval`` windows) every key and value is stored through each codec and read
back (SPECTRA's keys rotated to their positions after decoding), and the last ``--queries`` queries of each head
attend over them. The error is the attention output's, relative to the exact one (||o' - o|| / ||o||, pooled over
the queries of a head, then averaged over heads), with the attention weights' total variation beside it. Rows of
one byte width are one comparison: ``int4`` (groups of 32: 32 bytes of codes + 8 of scales) against SPECTRA at 4
bits in groups of 32 (the same 40; ``spectra4``) and at 3 bits in groups of 16 (24 + 16). ``-sampled``: the basis
from the moments ``kvcompile.apply`` measures (text the model samples itself), not from the prose. Writes
``bench/results/spectra/spectra.{json,md}``.

    python bench/spectra.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import time

import torch
from record import Results

import kvcompile
from kvcompile.calibration import latent as calibration
from kvcompile.calibration import prefill_heads
from kvcompile.eval.fidelity import calibration_windows
from kvcompile.kernels import latent
from kvcompile.kernels.formats import IntCodec

# (codec, bits, group); "-sampled": the moments apply measures (text the model samples itself); "saki": SAKI's keys
# (its score-preserving basis, bits by score error) beside values as int4 (the format saki4)
CODECS = [("int4", 4, 32), ("spectra", 4, 32), ("spectra-sampled", 4, 32), ("saki", 4, 32), ("spectra", 3, 16),
          ("int3", 3, 32), ("spectra", 3, 32), ("spectra", 2, 16), ("int2", 2, 32), ("spectra", 2, 32)]


def _label(kind: str, bits: int, group: int) -> str:
    return kind if kind.startswith("int") else f"{kind.replace('spectra', f'spectra{bits}/g{group}')}".replace(
        "saki", f"saki{bits}")


def _bases(moments, kind: str, bits: int, group: int, rotary) -> torch.Tensor:
    """[L, 2, Hkv, 2D + 3, D] the bases a latent format of ``kind`` ("spectra" or "saki") keeps (``latent``)."""
    keys = latent.LatentCodec(bits, group, rotary=True, basis=kind)
    values = latent.LatentCodec(bits, group, basis="identity" if kind == "saki" else kind)
    return latent.model_basis((keys, values), moments, rotary, moments[0].keys.shape[-1])


def _int_round_trip(bits: int, group: int, x):
    codec = IntCodec(bits, group)
    return codec.decode(*codec.encode(x), torch.float32), codec.row_bytes(x.shape[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--calib", type=int, default=4, help="calibration windows of --length tokens")
    parser.add_argument("--eval", type=int, default=2, help="evaluation windows (other prose)")
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--out", help="path stem of what is written (default bench/results/spectra/spectra)")
    args = parser.parse_args()
    results = Results("spectra", args.out)

    t0 = time.perf_counter()
    model, tok = kvcompile.load_model(args.model)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    calib, held_out = calibration_windows(tok, args.calib, args.eval, args.length)
    moments = calibration.calibrate(cm, calib)
    rotary = cm.spec.rotary or [()] * cm.spec.num_layers
    energy = {"keys": [], "values": []}
    for layer in moments:
        for name, m in (("keys", layer.keys), ("values", layer.values)):
            values = torch.linalg.eigvalsh(m).flip(-1)
            energy[name].append((values[:, : m.shape[-1] // 4].sum(-1) / values.sum(-1)).mean().item())
    sampled = calibration.sampled_moments(cm)
    bases = {(kind, bits, group): _bases(sampled if kind.endswith("-sampled") else moments, kind.split("-")[0], bits,
                                         group, rotary)
             for kind, bits, group in CODECS if not kind.startswith("int")}
    sums: dict[str, list[float]] = {}
    row_bytes: dict[str, int] = {}
    for window in held_out:
        layers = prefill_heads(cm, window)
        for layer, (q, q_pos, keys, values, pos) in enumerate(layers):
            last = q_pos[0] >= int(q_pos[0].max()) - args.queries + 1
            queries, qp = q[:, last], q_pos[:, last]
            mask = (pos[:, None, :] >= 0) & (pos[:, None, :] <= qp[:, :, None])
            exact_w = torch.softmax((queries @ keys.transpose(-1, -2) * cm.programs.layers[layer].scale)
                                    .masked_fill(~mask, float("-inf")), -1)
            exact = exact_w @ values
            for kind, bits, group in CODECS:
                label = _label(kind, bits, group)
                if not kind.startswith("int"):
                    kb, vb = bases[(kind, bits, group)][layer]
                    k = latent.decode(*latent.encode(keys, kb, group, pos), kb, pos)
                    v = latent.decode(*latent.encode(values, vb, group), vb)
                    row_bytes[label] = latent.LatentCodec(bits, group).row_bytes(keys.shape[-1])
                else:
                    (k, row_bytes[label]), (v, _) = (_int_round_trip(bits, group, keys),
                                                     _int_round_trip(bits, group, values))
                w = torch.softmax((queries @ k.transpose(-1, -2) * cm.programs.layers[layer].scale)
                                  .masked_fill(~mask, float("-inf")), -1)
                out = w @ v
                error = ((out - exact).norm(dim=(-1, -2)) / exact.norm(dim=(-1, -2))).mean().item()
                tv = (0.5 * (w - exact_w).abs().sum(-1)).mean().item()
                sums.setdefault(label, []).append((error, tv))
    summary = [{"codec": label, "bytes_per_row": row_bytes[label],
                "bits_per_channel": 8 * row_bytes[label] / cm.spec.head_dim,
                "output_error": sum(e for e, _ in v) / len(v), "weights_tv": sum(t for _, t in v) / len(v)}
               for label, v in sums.items()]
    meta = {"model": args.model, "length": args.length, "calib_windows": args.calib, "eval_windows": args.eval,
            "queries": args.queries, "head_dim": cm.spec.head_dim, "seconds": time.perf_counter() - t0,
            "top_quarter_energy": {name: sum(v) / len(v) for name, v in energy.items()}}
    results.json({"meta": meta, "summary": summary})
    share = meta["top_quarter_energy"]
    lines = [f"SPECTRA against integer pages on {args.model} (head_dim {cm.spec.head_dim}), {args.eval} x "
             f"{args.length}-token prose windows, moments from {args.calib} other windows; the last {args.queries} "
             "queries of each head, every layer. Error: ||o' - o|| / ||o|| of the attention output; TV: total "
             "variation of the attention weights. Top quarter of latent channels holds "
             f"{share['keys']:.1%} of the keys' energy, {share['values']:.1%} of the values'.", "",
             "| codec | bytes / row (K or V) | bits / channel | output error | weights TV |", "|---|---|---|---|---|"]
    ordered = sorted(summary, key=lambda s: (-s["bytes_per_row"], s["output_error"]))
    lines += [f"| {s['codec']} | {s['bytes_per_row']} | {s['bits_per_channel']:.2f} | {s['output_error']:.4f} | "
              f"{s['weights_tv']:.4f} |" for s in ordered]
    results.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
