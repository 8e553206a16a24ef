"""kvpress's own presses run again with one choice changed toward kvcompile's, on the prompts of
``bench/compare_kvpress.py`` (same model, token ids, answers scored the same way, next-token KL against the full
cache it saved): where the grid finds the two libraries apart, this says which choice moved the number. Run in the
kvpress environment, after that script's ``prompts`` step and its kvpress step's full-budget run:

    <kvpress venv>/bin/python bench/kvpress_variants.py blockpress --dir D --budget 0.1
    <kvpress venv>/bin/python bench/kvpress_variants.py criticalkv --dir D --budget 0.25

``blockpress``: kvpress's ``BlockPress`` says of itself that it "is not a true chunked-prefill implementation": every
key and value comes from one full prefill, and the blocks are only a schedule of top-k selections over them.
kvcompile's ``block`` recipes (``prefill_chunk=128``) prefill 128 tokens at a time and compress after each block, so
a later block's keys and values are computed over what was kept. The variants:

- ``simulated`` (kvpress as shipped): the first ``n_kept`` tokens, then blocks of 128 each scored with what was
  kept and cut back to ``n_kept``, all on one full prefill's keys;
- ``real blocks``: the model reads blocks of 128 tokens (from the first) into its cache, and after each block every
  layer over ``n_kept`` keeps its top ``n_kept`` by ``KeyDiffPress.score`` (kvcompile's schedule, in kvpress).

``criticalkv``: kvpress's ``CriticalKVPress`` and ``CriticalAdaKVPress`` weigh each value by ||W_o v||_1 (the value
through its query heads' slices of the output projection, averaged over the group); kvcompile's ``criticalkv`` and
``adakv-criticalkv`` weigh it by ||v||_1, since its scorers see no model weights. The variants: each press as
shipped, and with ||v||_1 in place of ||W_o v||_1 (everything else kvpress's, its SnapKV average pool included);
CriticalKV also with ||v||_1 and its two stages splitting what SnapKV's window leaves, as kvcompile's do (kvpress's
first stage counts the window's 32 tokens, which score highest, among its share).

Writes ``bench/results/kvpress_variants/blockpress_protocol.{json,md}`` or ``.../criticalkv_vnorm.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path

import torch
from record import Results


class RealBlocks:
    """A press-like context manager: the context prefill goes in blocks of ``block`` tokens, each layer cut back to
    ``int(n * (1 - compression_ratio))`` tokens by ``scorer`` after every block that leaves it longer."""

    def __init__(self, scorer, compression_ratio: float, block: int = 128):
        self.scorer, self.ratio, self.block = scorer, compression_ratio, block

    @contextlib.contextmanager
    def __call__(self, model):
        inner = model.model.forward

        def blocks(input_ids, past_key_values, **kwargs):
            n = input_ids.shape[1]
            n_kept = int(n * (1 - self.ratio))
            for start in range(0, n, self.block):
                ids = input_ids[:, start:start + self.block]
                out = inner(input_ids=ids, past_key_values=past_key_values,
                            position_ids=torch.arange(start, start + ids.shape[1])[None], **kwargs)
                for layer in past_key_values.layers:
                    if layer.keys.shape[2] > n_kept:
                        scores = self.scorer.score(None, None, layer.keys, layer.values, None, {})
                        keep = scores.topk(n_kept, dim=-1).indices.sort(-1).values[..., None]
                        layer.keys = layer.keys.gather(2, keep.expand(-1, -1, -1, layer.keys.shape[-1]))
                        layer.values = layer.values.gather(2, keep.expand(-1, -1, -1, layer.values.shape[-1]))
            return out

        model.model.forward = blocks
        try:
            yield
        finally:
            model.model.forward = inner


def blockpress_variants(kvpress, ratio: float) -> dict:
    return {"simulated (kvpress's BlockPress)": lambda: kvpress.BlockPress(
                kvpress.KeyDiffPress(compression_ratio=ratio), block_size=128),
            "real blocks (kvcompile's schedule)": lambda: RealBlocks(kvpress.KeyDiffPress(), ratio)}


def criticalkv_variants(kvpress, ratio: float) -> dict:
    def plain_norm(values, module):  # ||v||_1 per KV head and token, where kvpress takes ||W_o v||_1
        return values.norm(p=1, dim=-1)

    class CriticalPlain(kvpress.CriticalKVPress):
        vwl1norm = staticmethod(plain_norm)

    class CriticalPlainSplit(CriticalPlain):
        """And the stages split what SnapKV's protected window leaves (kvcompile's), where kvpress's first stage
        counts the window among its top ``first_stage_ratio`` share."""

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
            top = torch.finfo(scores.dtype).max
            protected = scores >= scores.amax(-1, keepdim=True)  # SnapKV's window: the row's max, repeated
            kept = int((1 - self.compression_ratio) * keys.shape[2])
            free = max(kept - int(protected.sum(-1).max()), 0)
            first = scores.masked_fill(protected, float("-inf")).topk(int(free * self.first_stage_ratio), -1).indices
            out = ((scores + self.epsilon) * self.vwl1norm(values, module)).masked_fill(protected, top)
            return out.scatter(-1, first, top)

    class CriticalAdaPlain(kvpress.CriticalAdaKVPress):
        def compress(self, *args, **kwargs):  # it calls CriticalKVPress.vwl1norm by name
            shipped = kvpress.CriticalKVPress.vwl1norm
            kvpress.CriticalKVPress.vwl1norm = staticmethod(plain_norm)
            try:
                return super().compress(*args, **kwargs)
            finally:
                kvpress.CriticalKVPress.vwl1norm = shipped

    snap = lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)  # noqa: E731
    return {"CriticalKV(SnapKV), ‖W_o v‖₁ (as shipped)": lambda: kvpress.CriticalKVPress(
                snap(), epsilon=1e-4, first_stage_ratio=0.5),
            "CriticalKV(SnapKV), ‖v‖₁": lambda: CriticalPlain(
                snap(), epsilon=1e-4, first_stage_ratio=0.5),
            "CriticalKV(SnapKV), ‖v‖₁, stages split after the window (kvcompile's)": lambda: CriticalPlainSplit(
                snap(), epsilon=1e-4, first_stage_ratio=0.5),
            "CriticalAdaKV(SnapKV), ‖W_o v‖₁ (as shipped)": lambda: kvpress.CriticalAdaKVPress(
                snap(), alpha_safeguard=0.2, epsilon=1e-4, first_stage_ratio=0.5),
            "CriticalAdaKV(SnapKV), ‖v‖₁": lambda: CriticalAdaPlain(
                snap(), alpha_safeguard=0.2, epsilon=1e-4, first_stage_ratio=0.5)}


STUDIES = {"blockpress": (blockpress_variants, "blockpress_protocol",
                          "kvpress's BlockPress(KeyDiff), simulated and real blocks"),
           "criticalkv": (criticalkv_variants, "criticalkv_vnorm",
                          "kvpress's CriticalKV presses, with ‖W_o v‖₁ and with ‖v‖₁")}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=list(STUDIES))
    p.add_argument("--dir", type=Path, default=Path("/tmp/kvc/kvpress"), help="compare_kvpress.py's --dir")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--prompts", type=int, default=10, help="the first N per task")
    p.add_argument("--out", default=None, help="default: bench/results/kvpress_variants/<the study's file name>")
    args = p.parse_args()
    make_variants, file_name, title = STUDIES[args.study]
    results = Results("kvpress_variants", args.out, name=file_name)
    torch.set_num_threads(1)
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    data = json.loads((args.dir / "prompts.json").read_text())
    full = torch.load(args.dir / "kvpress_full.pt")["runs"]  # prompt index -> (answer, reference logits, ...)
    model = AutoModelForCausalLM.from_pretrained(args.dir / "model", attn_implementation="sdpa").eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tok = AutoTokenizer.from_pretrained(args.dir / "model")
    ratio = 1 - args.budget
    variants = make_variants(kvpress, ratio)
    per_task, chosen = {}, []
    for i, q in enumerate(data["prompts"]):
        per_task[q["task"]] = per_task.get(q["task"], 0) + 1
        if per_task[q["task"]] <= args.prompts:
            chosen.append(i)
    rows = []
    for name, make in variants.items():
        kls, scores = [], []
        for i in chosen:
            q = data["prompts"][i]
            n = len(q["context"])
            cache = DynamicCache()
            with torch.no_grad():
                with make()(model):
                    model.model(input_ids=torch.tensor([q["context"]]), past_key_values=cache)
                ref_cache = copy.deepcopy(cache)
                pos = torch.arange(n, n + len(q["question"]))[None]
                out = model(torch.tensor([q["question"]]), past_key_values=cache, position_ids=pos).logits[0]
                tokens, at = [int(out[-1].argmax())], n + len(q["question"])
                while tokens[-1] not in eos and len(tokens) < q["max_new_tokens"]:
                    out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache,
                                position_ids=torch.tensor([[at]]))
                    tokens.append(int(out.logits[0, -1].argmax()))
                    at += 1
                pos = torch.arange(n, n + len(q["reference"]))[None]
                logits = model(torch.tensor([q["reference"]]), past_key_values=ref_cache,
                               position_ids=pos).logits[0, :-1]
            lp_full, lp = torch.log_softmax(full[i][1].float(), -1), torch.log_softmax(logits.float(), -1)
            kls += (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0).tolist()
            pred = tok.decode(tokens, skip_special_tokens=True).lower()
            scores.append(sum(a.lower() in pred for a in q["answers"]) / len(q["answers"]))
        rows.append({"variant": name, "kl_mean": sum(kls) / len(kls), "score": sum(scores) / len(scores),
                     "scores": scores})
        print(f"{name:<72} KL {rows[-1]['kl_mean']:.3f} score {rows[-1]['score']:.3f}", flush=True)
    meta = {"budget": args.budget, "prompts": len(chosen), "tasks": sorted(per_task), "threads": 1}
    results.json({**meta, "rows": rows})
    lines = [f"# {title} (budget {args.budget}, {len(chosen)} prompts: the first {args.prompts} of "
             f"{', '.join(sorted(per_task))})", "",
             "| variant | KL mean | score |", "|---|---|---|"]
    lines += [f"| {r['variant']} | {r['kl_mean']:.3f} | {r['score']:.3f} |" for r in rows]
    results.markdown("\n".join(lines))


if __name__ == "__main__":
    main()
