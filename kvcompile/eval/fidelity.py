"""Task-independent fidelity of a compressed cache against the full one.

Protocol: a context of ``context`` prose tokens (``pydoc_data``) is prefilled once at full budget (all but its
last token, ``compress=False``); each (recipe, budget) cell forks that cache and compresses it; then the last
context token and ``scored`` continuation tokens are teacher-forced over the compressed cache and over the full one.

- Local, per layer and KV head (oracle-style: the continuation's queries as computed with the full cache):
  dropped attention mass ``m`` = attention the evicted tokens received, and the attention-output relative error
  ``|o' - o| / |o|`` with ``o' = (o - sum_evicted a_j v_j) / (1 - m)`` (the kept weights renormalised): the
  selection alone; and the same error over what the compressed cache holds (merged values, summaries and
  prototypes with their weights): ``merge_recovery`` = 1 - the second / the first, the share of the selection's
  error the merge step recovers (0 for eviction alone, negative where merging hurts; ``output_errors``).
- End to end: next-token KL(full || compressed) (mean, p99, max), top-1 agreement, perplexity of both over every
  scored token, and greedy agreement over ``greedy_tokens`` free-running tokens (first window only).
- ``oracle``: keeps the context tokens the continuation's queries attend to most (future attention, summed over
  queries and each GQA group): an upper bound for any policy that must decide before the continuation is read.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor
from tqdm import tqdm

import kvcompile

from ..methods import Observation
from ..model import CompressedModel
from ..observation import observe
from ..recipes import Recipe, get_recipe
from .decoding import greedy, ids_tensor, read_question
from .oracle import future_attention
from .store import cell_keys
from .synthetic import _prose


def next_token_metrics(full: Tensor, comp: Tensor, targets: Tensor) -> dict:
    """full, comp: logits [T, V] at the same positions; targets [T] the next tokens.

    Returns per-position KL(full || comp) summaries, top-1 agreement and the summed NLL of both."""
    lp_full, lp_comp = torch.log_softmax(full.float(), -1), torch.log_softmax(comp.float(), -1)
    kl = (lp_full.exp() * (lp_full - lp_comp)).sum(-1).clamp_min(0)
    t = targets[:, None].to(full.device)
    return {
        "kl": kl,
        "top1": (full.argmax(-1) == comp.argmax(-1)).float(),
        "nll_full": -lp_full.gather(-1, t).squeeze(-1),
        "nll": -lp_comp.gather(-1, t).squeeze(-1),
    }


def summarize(parts: list[dict]) -> dict:
    """Mean/p99/max KL, top-1 agreement and perplexities over the positions of several ``next_token_metrics``."""
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    kl = cat["kl"]
    ppl_full, ppl = math.exp(float(cat["nll_full"].mean())), math.exp(float(cat["nll"].mean()))
    return {
        "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max()),
        "top1": float(cat["top1"].mean()), "ppl_full": ppl_full, "ppl": ppl, "ppl_ratio": ppl / ppl_full,
        "scored_tokens": int(kl.numel()),
    }


def local_errors(probe: CompressedModel, kept: CompressedModel, n_compressed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Dropped attention mass, and attention-output relative error without and with the merge step, each [L, Hkv]
    (mean over observed queries; ``output_errors`` per layer).

    ``probe`` holds the full context then the continuation and observed the continuation's queries; ``kept`` is
    the compressed cache (its first ``n_compressed`` positions were subject to compression)."""
    rows = []
    for layer in probe.programs.layers:
        keys, values, positions, valid = kept.cache.dense(layer.index)
        held = Observation(keys, values, positions, valid, *[None] * 2, 0.0, 0, layer.index, 0,
                           log_weights=kept.cache.log_weights(layer.index))
        rows.append(output_errors(observe(probe.cache, layer), held, n_compressed))
    return tuple(torch.stack(x) for x in zip(*rows))


def output_errors(full: Observation, held: Observation, n_compressed: int) -> tuple[Tensor, Tensor, Tensor]:
    """For the queries ``full`` observed (over the full cache), per KV head [Hkv] (mean over queries, rows and
    each GQA group):

    - the attention mass the dropped tokens received: the full cache's tokens below ``n_compressed`` that ``held``
      (the compressed cache's dense view; its queries unused) does not hold as they were (same position, same key);
    - the selection's error ``|o' - o| / |o|``, ``o'`` over the tokens held as they were, their weights renormalised:
      eviction alone;
    - the compressed cache's error: ``o'`` the attention over what ``held`` really holds (merged values, summary and
      prototype entries with their log-weights), plus the full cache's tokens from ``n_compressed`` on.

    Their gap is what the merge step recovers of the selection's error (0 for a recipe that only evicts)."""
    B, Hkv, S, D = full.keys.shape
    same = (full.positions[..., :, None] == held.positions[..., None, :]) & full.valid[..., :, None] \
        & held.valid[..., None, :]
    b, h, i, j = same.nonzero(as_tuple=True)
    exact = (full.keys[b, h, i] == held.keys[b, h, j]).all(-1)
    kept = torch.zeros_like(full.valid).index_put_((b[exact], h[exact], i[exact]), torch.ones_like(exact[exact]))
    attn = full.window_attention()  # [B, Hq, W, S]
    group = attn.shape[1] // Hkv
    evicted = full.valid & ~kept & (full.positions < n_compressed)
    ev = evicted.repeat_interleave(group, 1)[:, :, None, :].float()
    values = full.values.float().repeat_interleave(group, 1)  # [B, Hq, S, D]
    m = (attn * ev).sum(-1)  # [B, Hq, W]
    o = attn @ values
    o_kept = (o - (attn * ev) @ values) / (1 - m).clamp_min(1e-6)[..., None]
    later = full.valid & (full.positions >= n_compressed)  # the continuation: never compressed
    weights = torch.zeros(B, Hkv, held.keys.shape[2], device=o.device) if held.log_weights is None else held.log_weights
    both = Observation(torch.cat([held.keys.float(), full.keys.float()], 2),
                       torch.cat([held.values.float(), full.values.float()], 2),
                       torch.cat([held.positions, full.positions], 2), torch.cat([held.valid, later], 2),
                       full.queries, full.query_positions, full.scale, full.window, full.layer, full.num_layers,
                       log_weights=torch.cat([weights, torch.zeros(B, Hkv, S, device=o.device)], 2))
    o_held = both.window_attention() @ both.values.repeat_interleave(group, 1)

    def per_head(x):  # [B, Hq, W] -> [Hkv]
        return x.mean((0, 2)).reshape(Hkv, group).mean(-1)

    norm = o.norm(dim=-1).clamp_min(1e-12)
    return (per_head(m), per_head((o_kept - o).norm(dim=-1) / norm), per_head((o_held - o).norm(dim=-1) / norm))


def prose_windows(tokenizer, n_windows: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n_windows`` token windows of ``length`` from ``pydoc_data`` prose, at different offsets (deterministic)."""
    prose = _prose()
    out = []
    for i in range(n_windows):
        start = (seed * 7919 + i * len(prose) // max(n_windows, 1)) % len(prose)
        ids: list[int] = []
        j = start
        while len(ids) < length:
            ids += tokenizer(prose[j % len(prose)] + " ", add_special_tokens=False)["input_ids"]
            j += 1
        out.append(ids[:length])
    return out


def calibration_windows(tokenizer, n_calib: int, n_eval: int, length: int) -> tuple[list[Tensor], list[Tensor]]:
    """(calibration, evaluation) prose windows as input_ids [1, length], from different offsets: a method
    calibrated on the first is measured on text it never saw."""
    calib, held_out = (prose_windows(tokenizer, n, length, seed=seed) for n, seed in ((n_calib, 0), (n_eval, 1)))
    if {tuple(w[:32]) for w in calib} & {tuple(w[:32]) for w in held_out}:
        raise ValueError("the evaluation windows overlap the calibration windows")
    return [torch.tensor([w]) for w in calib], [torch.tensor([w]) for w in held_out]


def measure(
    cm: CompressedModel,
    tokenizer,
    recipes: list[str | Recipe],
    budgets: list[float | int | str],
    *,
    context: int = 1024,
    scored: int = 512,
    windows: int = 4,
    greedy_tokens: int = 64,
    oracle: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """One row per (recipe, budget) (plus ``oracle`` rows): the metrics in the module docstring."""
    if context < 2 or scored < 1:
        raise ValueError(f"need context >= 2 and scored >= 1 tokens, got {context}, {scored}")
    recipes = [get_recipe(r) for r in recipes]
    widest = max([r.build()[0].observation_window for r in recipes if r.scorer] + [0])
    if scored < widest:  # the shared cache observes exactly the scored queries; recipes slice their window from it
        raise ValueError(f"scored={scored} must be at least the widest observation window ({widest})")
    probe_recipe = Recipe("oracle-probe", "oracle", scorer_args={"window": scored})
    base_model = kvcompile.apply(cm, budget=1.0, recipe=probe_recipe)
    cells = [(r, b) for r in recipes for b in budgets] + ([(ORACLE, b) for b in budgets] if oracle else [])
    acc: dict[int, dict] = {i: {"parts": [], "mass": [], "err": [], "merged": [], "windows": []}
                            for i in range(len(cells))}
    texts = prose_windows(tokenizer, windows, context + scored, seed)
    bar = tqdm(total=len(texts) * len(cells), disable=not progress, desc="fidelity")
    for w, ids in enumerate(texts):
        ctx, cont = ids[:context], ids[context:]
        base_model.reset()
        base_model.prefill(ids_tensor(ctx[:-1], base_model.device), compress=False, logits="last")
        tail = ctx[-1:] + cont[:-1]
        probe = base_model.fork()
        full_logits = probe.prefill(ids_tensor(tail, probe.device), compress=False, logits="all")[0]
        targets = torch.tensor(cont)
        full_greedy = None
        if w == 0 and greedy_tokens:
            g = base_model.fork()
            full_greedy = greedy(g, read_question(g, ctx[-1:]), greedy_tokens)
        future = None
        for i, (recipe, budget) in enumerate(cells):
            t0 = time.perf_counter()
            if recipe is ORACLE:
                if future is None:
                    future = future_attention(probe.cache, probe.programs.layers, context - 1)
                recipe = Recipe("oracle", "oracle", scorer_args={"scores": future})
            kept = base_model.fork(recipe, budget)
            kept.compress()
            stats = kept.cache_stats()
            mass, err, merged = local_errors(probe, kept, context - 1)
            acc[i]["mass"].append(mass)
            acc[i]["err"].append(err)
            acc[i]["merged"].append(merged)
            if full_greedy is not None:
                g = kept.fork()
                ours = greedy(g, read_question(g, ctx[-1:]), greedy_tokens)
                same = [a == b for a, b in zip(full_greedy, ours)]
                acc[i]["greedy_agree"] = sum(same) / len(same)
                acc[i]["greedy_first_diff"] = same.index(False) if False in same else len(same)
            logits = kept.prefill(ids_tensor(tail, kept.device), compress=False, logits="all")[0]
            part = next_token_metrics(full_logits, logits, targets)
            acc[i]["parts"].append(part)
            acc[i]["windows"].append({**{k: stats[k] for k in ("bytes_held", "bytes_allocated", "bytes_full")},
                                      **_window_kl(summarize([part])), "wall_s": time.perf_counter() - t0})
            bar.update(1)
    bar.close()
    rows = []
    for i, (recipe, budget) in enumerate(cells):
        a = acc[i]
        mass, err, merged = (torch.stack(a[k]).mean(0) for k in ("mass", "err", "merged"))
        held = [w["bytes_held"] for w in a["windows"]]
        rows.append({
            "recipe": recipe.tag,
            "budget": str(kvcompile.Budget.parse(budget)),
            **summarize(a["parts"]),
            "greedy_agree": a.get("greedy_agree"),
            "greedy_first_diff": a.get("greedy_first_diff"),
            "dropped_mass": float(mass.mean()),
            "attn_rel_err": float(err.mean()),
            "attn_rel_err_merged": float(merged.mean()),
            "merge_recovery": 1 - float(merged.mean()) / max(float(err.mean()), 1e-12),
            "bytes_held_mean": sum(held) / len(held),
            "dropped_mass_layer_head": mass.tolist(),
            "attn_rel_err_layer_head": err.tolist(),
            "attn_rel_err_merged_layer_head": merged.tolist(),
            "context_tokens": context,
            "windows": len(texts),
            "per_window": a["windows"],  # the results store's rows (``store_rows``)
            "cell": (recipe, budget),  # as given (``store_rows`` keys rows by it, as the sweep does)
        })
    return rows


# The oracle's cells, keyed in the store by this record (its scores are the continuation's, set per window): a
# control that sees the continuation, hence query-aware.
ORACLE = Recipe("oracle", "oracle", provenance="control", query_aware=True)


def _window_kl(summary: dict) -> dict:
    return {"kl_mean": summary["kl_mean"], "kl_p99": summary["kl_p99"], "top1": summary["top1"],
            "kl_tokens": summary["scored_tokens"]}


def store_rows(rows: list[dict], model: str, dtype: str, seed: int = 0) -> list[dict]:
    """``measure``'s rows as results-store rows: task ``fidelity``, one sample per window, KL and bytes as
    measured, no score (fidelity has none). ``model``: the name as given; ``dtype``: the cache's."""
    out = []
    for row in rows:
        length = row["context_tokens"] + row["per_window"][0]["kl_tokens"]
        for w, window in enumerate(row["per_window"]):
            key = cell_keys([row["cell"]], model, "fidelity", w, length, seed, dtype)[0]
            out.append({**key, **window, "query_aware": row["cell"][0].query_aware})
    return out
