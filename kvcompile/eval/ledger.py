"""The risk ledger of one compressed request (issue 20 item 6; witprobe, INFERRED: the paper was not
found; the tiers are our reading of its description, kept to what a sweep cell can state).

Each claim the sweep makes about a cell is filed under one tier:

- ``certified``: exact by construction, read from the cache's own accounting: the budget asked for, its bytes,
  the bytes held and allocated, whether the bytes held fit the budget (None at full budget: no budget in bytes),
  the tokens held;
- ``bounded``: valid for the queries compression observed (the context's last ``window`` queries), extrapolated
  to later ones: the attention mass those queries put on the entries compression dropped (D(S) of the ceiling
  analysis, which bounds their output error by D(S) x max ||v_i - v_j||): its largest and mean value over layers,
  query heads and queries (None for a recipe that observes no queries, e.g. StreamingLLM: nothing is bounded there);
- ``empirical``: measured on this one sample only: score, KL, top-1 agreement, UOR.

The sweep writes the ledger beside every row (the store's ``ledger`` column, JSON), with its own values of the
certified and bounded fields; the empirical fields are named, their values are the row's columns.
"""

from __future__ import annotations

import json

import torch

from ..observation import observe

TIERS = ("certified", "bounded", "empirical")
EMPIRICAL = ("score", "kl_mean", "kl_p99", "top1", "uor")


@torch.no_grad()
def dropped_mass(before, after) -> dict:
    """``{"dropped_mass_max", "dropped_mass_mean", "window"}``: the attention the observed queries of ``before`` (a
    ``CompressedModel`` holding the context uncompressed and observed: a fork taken before ``compress``) put on
    the entries ``after`` (its compression) no longer holds, over every layer, query head and real query; None
    where it observed none (a recipe whose scorer reads no queries: ``window`` 0)."""
    held = after.held_positions().long()  # [L, B, Hkv, S]
    worst, total, count, window = None, 0.0, 0, 0
    with before.observing(dense=False) as (cache, _):  # KVgrad's gradients weigh queries; the mass needs none
        for layer in before.programs.layers:
            obs = observe(cache, layer)
            n = int(obs.positions.max()) + 1
            pos = held[obs.layer]
            kept = torch.zeros(*pos.shape[:2], n + 1, dtype=torch.bool, device=pos.device)
            kept.scatter_(-1, torch.where((pos >= 0) & (pos < n), pos, n), True)
            kept = kept.gather(-1, obs.positions.clamp(0, n)) & obs.valid  # [B, Hkv, S]
            attn = obs.window_attention()  # [B, Hq, W, S]
            G = attn.shape[1] // kept.shape[1]
            lost = 1 - (attn * kept.repeat_interleave(G, 1)[:, :, None, :]).sum(-1)  # [B, Hq, W]
            real = (obs.query_positions >= 0)[:, None, :].expand_as(lost)
            if real.any():
                worst = max(worst or 0.0, float(lost[real].max()))
            total, count = total + float(lost[real].sum()), count + int(real.sum())
            window = max(window, int((obs.query_positions >= 0).sum(-1).max()))
    return {"dropped_mass_max": worst, "dropped_mass_mean": total / count if count else None, "window": window}


def ledger(stats: dict, budget, bounded: dict | None) -> dict:
    """The ledger of one request: ``stats`` its ``cache_stats()`` once compressed, ``budget`` the budget asked for,
    ``bounded`` its ``dropped_mass`` (None: not measured, e.g. a full-budget cell, which drops nothing)."""
    return {"certified": {"budget": str(budget), "budget_bytes": stats["budget_bytes"],
                          "bytes_held": stats["bytes_held"], "bytes_allocated": stats["bytes_allocated"],
                          "within_budget": None if stats["budget_bytes"] is None else
                          stats["bytes_held"] <= stats["budget_bytes"],
                          "tokens_held": stats["tokens_held"]},
            "bounded": dict(bounded or {}),
            "empirical": list(EMPIRICAL)}


def dumps(entry: dict) -> str:
    """The ledger as the store's ``ledger`` column holds it."""
    return json.dumps(entry, sort_keys=True)
