"""SeqCalib, HeadWiseKV's calibration (docs/methods_allocators.md#headwisekv): each KV head's window level, chosen layer
by layer in execution order under the aggregate budget, each layer measured with the lower layers already holding only
their chosen windows (``methods.headwisekv``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..budget import Budget
from ..methods.headwisekv import LEVELS, recent_tokens, window_error
from ..model import CompressedModel
from ..observation import observe
from ..recipes import Recipe
from . import cached_calibration


def calibrate(model, samples: list[Tensor], budgets, levels=LEVELS, sinks: int = 4, probe: int = 32) -> dict:
    """{budget: windows [L][Hkv]} for each fraction in ``budgets``: HeadWiseKV's ``windows`` for a
    ``CompressedModel`` at that budget, from the calibration ``samples`` (input_ids [1, T]; the last ``probe``
    tokens of each are the queries that read the compressed rest). Cached per model, samples and parameters.

    Per layer, in execution order: the sample's context is prefilled and compressed with the lower layers at
    their chosen windows, the probe read, and this layer's output error per head and level measured
    (``window_error``); the layer then gets the remaining budget over the remaining layers, spent greedily on the
    level upgrades that remove the most error per token. A token a sliding-window layer cannot see costs nothing.
    Budgets are chosen smallest first, each from the previous one's windows upward, so windows are monotone in the
    budget. Inferred: the criterion, the greedy split and the per-layer share (the paper was read as a summary)."""
    fractions = sorted(float(b) for b in budgets)
    if not fractions or not all(0.0 < b <= 1.0 for b in fractions):
        raise ValueError(f"budgets must be fractions in (0, 1], got {budgets!r}")
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 or s.shape[1] <= probe + sinks for s in samples):
        raise ValueError(f"samples must be input_ids of shape [1, T] with T > probe + sinks ({probe + sinks})")
    if sorted(levels) != list(levels) or levels[0] < 0 or levels[-1] != 1.0 or sinks < 0 or probe < 1:
        raise ValueError(f"need ascending levels in [0, 1] ending at 1, sinks >= 0 and probe >= 1, got {levels}, "
                         f"{sinks}, {probe}")
    ids = torch.cat([s.flatten() for s in samples])
    params = {"lengths": [s.shape[1] for s in samples], "budgets": fractions, "levels": list(levels),
              "sinks": sinks, "probe": probe}
    rows = cached_calibration("headwisekv", model, ids, params,
                              lambda: _choose(model, samples, fractions, list(levels), sinks, probe))
    return {b: tuple(tuple(layer) for layer in windows) for b, windows in zip(fractions, rows)}


def costs(context: int, window: int, sinks: int, levels: list[float]) -> Tensor:
    """[K] tokens a head keeps at each level after a ``context``-token prompt: its sinks and recent tokens, less
    those a sliding ``window`` (0: none) hides from every later query."""
    pos = torch.arange(context)
    visible = (pos > context - window) if window else torch.ones(context, dtype=torch.bool)
    recent = recent_tokens(torch.tensor(levels), torch.tensor(context))
    return torch.stack([((pos < sinks) | (pos >= context - r)) & visible for r in recent]).sum(1).double()


def _choose(model, samples, fractions, levels, sinks, probe) -> list[list[list[float]]]:
    spec = model.spec
    L, Hkv = spec.num_layers, spec.num_kv_heads
    cost = torch.stack([torch.stack([costs(s.shape[1] - probe, w, sinks, levels) / (s.shape[1] - probe)
                                     for s in samples]).mean(0) for w in spec.windows])  # [L, K] context fractions
    chosen, out = torch.zeros(L, Hkv, dtype=torch.long), []
    for fraction in fractions:
        spent = 0.0
        for layer in range(L):
            error = _errors(model, samples, chosen, layer, levels, sinks, probe)  # [Hkv, K]
            allowance = (fraction * L * Hkv - spent) / (L - layer)
            chosen[layer] = _greedy(error, cost[layer], chosen[layer], allowance)
            spent += float(cost[layer][chosen[layer]].sum())
        out.append([[levels[k] for k in row] for row in chosen.tolist()])
    return out


def _greedy(error: Tensor, cost: Tensor, floor: Tensor, allowance: float) -> Tensor:
    """Levels [Hkv] from ``floor`` up: while the allowance lasts, the upgrade (a head to a higher level) with the
    most error removed per token of cost that still fits; none removing error is taken."""
    level = floor.clone()
    while True:
        spent = float(cost[level].sum())
        gain = error[torch.arange(len(level)), level][:, None] - error  # [Hkv, K]
        extra = cost[None, :] - cost[level][:, None]
        ok = (torch.arange(error.shape[1])[None, :] > level[:, None]) & (gain > 0) & (spent + extra <= allowance + 1e-9)
        if not bool(ok.any()):
            return level
        ratio = (gain / extra.clamp_min(1e-12)).masked_fill(~ok, -1.0)
        head, k = divmod(int(ratio.argmax()), error.shape[1])
        level[head] = k


@torch.no_grad()
def _errors(model, samples, chosen: Tensor, layer: int, levels, sinks, probe) -> Tensor:
    """[Hkv, K] mean ``window_error`` of ``layer``'s heads at each level, the layers below at their ``chosen``
    levels (every layer from ``layer`` on keeps everything)."""
    Hkv = model.spec.num_kv_heads
    windows = [[levels[k] if i < layer else 1.0 for k in row] for i, row in enumerate(chosen.tolist())]
    recipe = Recipe("seqcalib", "headwisekv", "fill-eligible",
                    {"windows": windows, "sinks": sinks, "base": "snapkv", "base_args": {"window": probe}})
    total = torch.zeros(Hkv, len(levels), dtype=torch.float64)
    for ids in samples:
        context = ids.shape[1] - probe
        eligible = sum(int(costs(context, 0, sinks, [w]).item()) for row in windows for w in row)
        budget = Budget.parse(f"{eligible * model.cache.token_bytes}B")  # every eligible token, page_size 1
        runner = CompressedModel(model.programs, model.spec, recipe, budget, page_size=1, device=model.device,
                                 source=model.source)
        runner.prefill(ids[:, :context].to(runner.device), compress=False, logits="last")
        runner.compress()
        runner.prefill(ids[:, context:].to(runner.device), compress=False, logits="last")
        obs = observe(runner.cache, runner.programs.layers[layer])
        for k, w in enumerate(levels):
            recent = recent_tokens(torch.full((Hkv,), w), torch.tensor(context))
            total[:, k] += window_error(obs, context, sinks, recent).double().cpu()
    return total / len(samples)
