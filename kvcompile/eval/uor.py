"""Union overhead ratio (UOR): what GQA pooling saves, per method.

A KV head serves G query heads. Selecting per KV head stores k tokens; a per-query-head version of the same
method would let each query head keep its own top k, and since they share one KV head the cache would have to
store the union of those G selections. UOR = |union| / k, between 1 (the query heads agree) and G (they are
disjoint). Scorers without a per-query-head form (``Scorer.score_per_query_head`` returns None: key- or
value-only scores) have no UOR.

Example::

    rows = uor_table(cm, tok(text, return_tensors="pt").input_ids, budget=0.25, recipes=["tova", "h2o"])
"""

from __future__ import annotations

from torch import Tensor

from ..methods import Observation, Scorer
from ..methods.base import descending_rank
from ..observation import observe
from ..recipes import RECIPES, get_recipe


def union_sizes(per_query_head: Tensor, valid: Tensor, k: Tensor) -> Tensor:
    """Tokens [B, Hkv] the union of each query head's own top ``k`` [B, Hkv] covers, over each KV head's group.

    per_query_head: [B, Hq, S] scores; valid: [B, Hkv, S] held tokens."""
    B, Hq, S = per_query_head.shape
    Hkv = valid.shape[1]
    G = Hq // Hkv
    scores = per_query_head.float().masked_fill(~valid.repeat_interleave(G, 1), float("-inf"))
    rank = descending_rank(scores)
    top = (rank < k.repeat_interleave(G, 1)[..., None]) & valid.repeat_interleave(G, 1)
    return top.reshape(B, Hkv, G, S).any(2).sum(-1)


def union_overhead(scorer: Scorer, obs: Observation, fraction: float, held: Tensor | None = None) -> Tensor | None:
    """[B, Hkv] union sizes over k, where each head keeps k = round(fraction x tokens it holds); None when the
    scorer has no per-query-head form. ``held`` [B, Hkv, S]: the tokens that compete (default ``obs.valid``)."""
    scores = scorer.score_per_query_head(obs)
    if scores is None:
        return None
    held = obs.valid if held is None else held
    k = (fraction * held.sum(-1)).round().long().clamp_min(1)
    return union_sizes(scores, held, k) / k


def held_uor(cm, fraction: float) -> tuple[float | None, list[float]]:
    """UOR of ``cm``'s scorer (a ``CompressedModel`` holding a context uncompressed and observed: after
    ``prefill(..., compress=False)``, or a fork of it) at a keep ``fraction`` of each head's context tokens: the
    overall ratio (tokens over all layers and heads) and one per layer; (None, []) for a scorer without a
    per-query-head form. A recipe with a reconstruction pass (KVzip) is measured on that pass's queries, as its
    compression sees them (the pass is run and dropped again: pass a fork you no longer need)."""
    if cm.scorer is None:
        return None, []
    context = cm.seen.clone()
    union, kept, per_layer = 0.0, 0.0, []
    with cm.observing() as (cache, dense):
        for layer in cm.programs.layers:
            obs = observe(cache, layer, dense)
            held = obs.valid & (obs.positions < context[:, None, None])  # the context, not a reconstruction
            ratio = union_overhead(cm.scorer, obs, fraction, held)
            if ratio is None:
                return None, []
            k = (fraction * held.sum(-1)).round().clamp_min(1)
            union, kept = union + float((ratio * k).sum()), kept + float(k.sum())
            per_layer.append(float((ratio * k).sum() / k.sum()))
    return union / kept, per_layer


def compress_measuring_uor(cm, input_ids: Tensor, **prefill) -> tuple[Tensor, float | None]:
    """Prefill ``input_ids`` [1, T] into ``cm`` and compress: the last logits [1, 1, V] and the union-overhead ratio
    of its scorer at the share of tokens it kept (``held_uor``, as the sweep measures it); ``prefill``: more
    arguments of ``CompressedModel.prefill`` (a task's ``segments``). The UOR is None, and the prefill compresses as
    it goes, where there is none to measure: no scorer, the full budget, a recipe that compresses while it prefills
    (chunked), while it decodes, or with the question (query-aware). Otherwise the context is prefilled
    uncompressed, then compressed (``compress``), the sweep's path, and the UOR read on an uncompressed fork."""
    if cm.scorer is None or cm.budget.is_full or cm.prefill_chunk or cm.schedule is not None \
            or cm.recipe.query_aware:
        return cm.prefill(input_ids, logits="last", **prefill), None
    logits = cm.prefill(input_ids, compress=False, logits="last", **prefill)
    unions = cm.fork()
    cm.compress()
    share = cm.cache_stats()["tokens_held"] / (int(cm.seen.sum()) * cm.spec.num_layers * cm.spec.num_kv_heads)
    return logits, held_uor(unions, share)[0]


def uor_table(model, input_ids: Tensor, budget: float = 0.25, recipes: list | None = None) -> list[dict]:
    """One row per recipe: UOR of its scorer on ``model`` (a ``CompressedModel``) after prefilling ``input_ids``
    [B, T], at a keep fraction of ``budget`` per head (``held_uor``): the overall ratio, and the lowest and highest
    layer; ``uor`` is None for scorers without a per-query-head form."""
    names = recipes if recipes is not None else [n for n, r in RECIPES.items() if r.scorer]
    rows = []
    for name in names:
        recipe = get_recipe(name)
        cm = model.fork(recipe, 1.0)  # the recipe's observation window, nothing compressed
        cm.reset()
        cm.prefill(input_ids, compress=False, logits="last")
        ratio, per_layer = held_uor(cm, budget)
        rows.append({
            "recipe": recipe.tag,
            "scorer": recipe.scorer,
            "uor": ratio,
            "uor_min_layer": min(per_layer) if per_layer else None,
            "uor_max_layer": max(per_layer) if per_layer else None,
            "group_size": cm.spec.num_q_heads // cm.spec.num_kv_heads,
        })
    return rows
