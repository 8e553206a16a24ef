"""Where a press's score differs between kvpress and kvcompile on one prompt of ``bench/compare_kvpress.py``'s grid:
the entries each library kept, and each kept set read by one independent reference (the plain transformers model
attending through masks, ``kvcompile.eval.analysis.masked``), so a difference in what was kept is told apart from a
difference in how the kept entries are read. Two steps, after the grid's ``prompts`` step:

    <kvpress venv>/bin/python bench/selection_agreement.py kvpress --dir D --cases "Knorm:0.5:4,StreamingLLM:0.5:17"
    python bench/selection_agreement.py kvcompile --dir D --cases "Knorm:0.5:4,StreamingLLM:0.5:17"

A case is ``press:budget:prompt`` (the prompt's index in ``prompts.json``); ``python bench/selection_agreement.py
diffs --dir D [--presses ...]`` prints every case of the grid where the two libraries' scores differ. The kvpress
step records which context positions every (layer, KV head) kept (the rows of the compressed cache matched to those
of a prefill without the press, or the masks a masked press leaves) in ``D/kept_kvpress.pt``; the kvcompile step
runs the pair's recipe on the same token ids (``--page-size``: its pages, 16 by default), reads
``CompressedModel.held_positions()``, and answers with both sets through the masked reference. Writes
``bench/results/selection_agreement/selection_agreement.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import compare_kvpress as grid
import torch
from record import Results


def cases(text: str) -> list[tuple[str, float, int]]:
    out = []
    for case in text.split(","):
        press, budget, index = case.rsplit(":", 2)
        out.append((press, float(budget), int(index)))
    return out


def kept_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """[Hkv, n] True where a row of ``before`` [1, Hkv, n, D] is among the rows of ``after`` [1, Hkv, m, D], to a
    relative 1e-4 (a press that prefills again, KVCompose, computes its rows in another attention implementation; a
    press that rewrites the rows it keeps, KeyRerotation or Merging, matches none: it is not for this probe)."""
    near = torch.cdist(after[0].double(), before[0].double()) <= 1e-4 * before[0].double().norm(dim=-1)[:, None]
    return near.any(1)


@torch.no_grad()
def kvpress_step(args) -> None:
    """Each case's kvpress selection [L, Hkv, n], kept positions True."""
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    data = json.loads((args.dir / "prompts.json").read_text())
    filters = -torch.tensor(json.loads((args.dir / "qfilters.json").read_text())["filters"])
    kvpress.QFilterPress.load_q_filters = staticmethod(lambda model_name: filters)  # as the grid's kvpress step
    model = AutoModelForCausalLM.from_pretrained(args.dir / "model", attn_implementation="sdpa").eval()
    path = args.dir / "kept_kvpress.pt"
    saved = torch.load(path) if path.exists() else {}
    full = {}  # each prompt's keys before any press: the rows a pruned cache keeps are matched to them
    for name, budget, index in cases(args.cases):
        ids = torch.tensor([data["prompts"][index]["context"]])
        if index not in full:
            model.config._attn_implementation = "sdpa"
            cache = DynamicCache()
            model.model(input_ids=ids, past_key_values=cache)
            full[index] = [layer.keys for layer in cache.layers]
        for module in model.modules():
            if getattr(module, "masked_key_indices", None) is not None:
                module.masked_key_indices = None
        model.config._attn_implementation = "eager" if name in grid.EAGER else "sdpa"
        cache = DynamicCache()
        with grid._press(name, 1 - budget, model.config.num_hidden_layers)(model):
            model.model(input_ids=ids, past_key_values=cache)
        layers = []
        for layer, decoder in enumerate(model.model.layers):
            keep = kept_rows(full[index][layer], cache.layers[layer].keys)
            masked = getattr(decoder.self_attn, "masked_key_indices", None)
            if masked is not None:  # a masked press: every row is still there, the mask says which are evicted
                keep[masked[1], masked[2]] = False
            layers.append(keep)
        saved[(name, budget, index)] = torch.stack(layers)
        torch.save(saved, path)  # after every case: a cut run keeps what it found
        print(name, budget, index, f"kept {saved[(name, budget, index)].float().mean():.3f}", flush=True)


@torch.no_grad()
def kvcompile_step(args) -> None:
    """kvcompile's selection of each case, against kvpress's, and both read by the masked reference."""
    import kvcompile
    from kvcompile.eval.analysis import masked
    from kvcompile.eval.decoding import answer, greedy, ids_tensor, read_question
    from kvcompile.eval.samples import string_match_all

    torch.set_num_threads(args.threads)
    data = json.loads((args.dir / "prompts.json").read_text())
    theirs_all = torch.load(args.dir / "kept_kvpress.pt")
    source, tok = kvcompile.load_model(data["model"])
    cm = kvcompile.apply(source, budget=1.0, recipe="full")
    eos = {t for t in (tok.eos_token_id, getattr(cm.generation_config, "eos_token_id", None)) if isinstance(t, int)}
    pairs = dict(grid.PAIRS)
    rows, documents = [], {}  # the plain model's cache of each prompt's context, read once
    for name, budget, index in cases(args.cases):
        prompt = data["prompts"][index]
        ctx, n = ids_tensor(prompt["context"], cm.device), len(prompt["context"])
        recipe = grid._recipe(pairs[name], source.config.num_hidden_layers, args.dir)
        model = kvcompile.apply(cm, budget=budget, recipe=recipe, page_size=args.page_size)
        model.reset()
        model.prefill(ctx, logits="last")
        ours, theirs = masked.kept(model.held_positions(), n), theirs_all[(name, budget, index)]
        tokens = greedy(model, read_question(model, prompt["question"]), prompt["max_new_tokens"], eos_ids=eos)
        score = lambda ids: string_match_all(prompt["answers"], tok.decode(ids, skip_special_tokens=True))  # noqa
        if index not in documents:
            documents[index] = masked.document(source, ctx)
        plain, read = documents[index], {}
        for side, keep in (("kvcompile", ours), ("kvpress", theirs)):
            reader = masked.MaskedModel(source, keep, plain)
            with masked.masking(source):
                read[side] = score(answer(reader, tok, reader.prefill(ids_tensor(prompt["question"], cm.device))[0, -1],
                                          prompt["max_new_tokens"]))
        both = (ours & theirs).sum(-1).float()
        jaccard = both / (ours | theirs).sum(-1).clamp_min(1)
        counts = ours.sum(-1) != theirs.sum(-1)
        rows.append({"press": name, "budget": budget, "prompt": index, "task": prompt["task"],
                     "jaccard_mean": float(jaccard.mean()), "jaccard_min": float(jaccard.min()),
                     "heads": int(jaccard.numel()), "heads_differing": int((jaccard < 1).sum()),
                     "heads_other_count": int(counts.sum()), "kept_kvcompile": int(ours.sum()),
                     "kept_kvpress": int(theirs.sum()), "only_kvcompile": int((ours & ~theirs).sum()),
                     "only_kvpress": int((theirs & ~ours).sum()), "score_kvcompile": score(tokens),
                     "masked_kvcompile_set": read["kvcompile"], "masked_kvpress_set": read["kvpress"]})
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    raw = json.loads((args.dir / "kvpress_raw.json").read_text())["cells"]
    for r in rows:  # kvpress's own score of the prompt in the grid
        cell = next(c for c in raw if c["press"] == r["press"] and c["budget"] == r["budget"])
        r["score_kvpress"] = cell["scores"][r["prompt"]]
    write(rows, Results("selection_agreement", args.out), " ".join(sys.argv), args.threads)


def write(rows: list[dict], out: Results, command: str, threads: int) -> None:
    out.json(rows)
    head = ("| press | budget | prompt | task | Jaccard mean | min | heads differing | of which by count | kept kvc "
            "| kept kvp | score kvc | score kvp | masked ref, kvc set | masked ref, kvp set |")
    lines = ["# The kept sets of kvpress and kvcompile on the prompts where their scores differ", "",
             f"`{command}` (SmolLM2-135M fp32, {threads} threads). Heads: (layer, KV head) pairs; 'by count': heads "
             "that keep a different number of entries. Scores: the grid's (kvpress's from its raw cell). The last "
             "two columns: the plain model reading through masks, with each library's kept set.", "", head,
             "|" + "---|" * 14]
    lines += [f"| {r['press']} | {r['budget']} | {r['prompt']} | {r['task']} | {r['jaccard_mean']:.3f} | "
              f"{r['jaccard_min']:.3f} | {r['heads_differing']}/{r['heads']} | {r['heads_other_count']} | "
              f"{r['kept_kvcompile']} | {r['kept_kvpress']} | {r['score_kvcompile']:.2f} | {r['score_kvpress']:.2f} | "
              f"{r['masked_kvcompile_set']:.2f} | {r['masked_kvpress_set']:.2f} |" for r in rows]
    out.markdown("\n".join(lines))


def diffs_step(args) -> None:
    """The cases where kvpress's raw cell and kvcompile's stored rows (the recipe's current version) score a prompt
    differently, as ``--cases`` reads them."""
    from kvcompile.eval.store import Store

    data = json.loads((args.dir / "prompts.json").read_text())
    raw = json.loads((args.dir / "kvpress_raw.json").read_text())["cells"]
    with Store(args.dir / "kvcompile.sqlite") as store:
        rows = store.rows()
    n_layers = json.loads((args.dir / "model" / "config.json").read_text())["num_hidden_layers"]
    out = []
    for press, name in grid._selected(args):
        recipe = grid._recipe(name, n_layers, args.dir)
        for cell in raw:
            if cell["press"] != press or len(cell["scores"]) != len(data["prompts"]):
                continue
            ours = grid.per_prompt(rows, data, recipe.name, cell["budget"], recipe.version)
            out += [f"{press}:{cell['budget']}:{i}" for i in sorted(ours) if ours[i][0] != cell["scores"][i]]
    print(",".join(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["diffs", "kvpress", "kvcompile"])
    p.add_argument("--dir", type=Path, default=grid.DEFAULT_DIR, help="compare_kvpress.py's --dir")
    p.add_argument("--cases", help="press:budget:prompt, comma-separated")
    p.add_argument("--presses", help="diffs: comma-separated kvpress names (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--page-size", type=int, default=16,
                   help="kvcompile's pages (1: a byte budget keeps kvpress's token counts)")
    p.add_argument("--out", help="path stem of what is written (default "
                   "bench/results/selection_agreement/selection_agreement)")
    args = p.parse_args()
    if args.step != "diffs" and not args.cases:
        p.error(f"the {args.step} step needs --cases (the diffs step lists them)")
    {"diffs": diffs_step, "kvpress": kvpress_step, "kvcompile": kvcompile_step}[args.step](args)


if __name__ == "__main__":
    main()
