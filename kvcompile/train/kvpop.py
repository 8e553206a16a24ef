"""Training data for KVpop's stateless scorer (``methods.kvpop``, docs/methods_learned.md#kvpop): per (layer, KV head),
what the cache holds of a token -> whether later queries attend to it most (keep) or not (drop).

Target (KVpop's): the attention mass token j receives from the queries at least ``window`` positions after it, summed
over its GQA group's query heads, ``y_j = Σ_{t >= j + w} A_{t,j}``. It comes from one prefill that observes every
query, a block of queries at a time: each block holds whole softmax rows, so the column sums are exact and no
T x T map is ever held (a two-pass form would tile keys too; a block of rows needs no second pass). Labels: keep iff
``y_j`` is in the top ``keep`` share of the candidates of its (context, layer, KV head), the candidates being the
tokens some query outside the window sees. Inferred (the paper's form is not known): the loss is binary
cross-entropy weighted by ``1 + boost * exp(-|rank - cut| / (0.05 n))``, so the tokens near the keep boundary,
where eviction decides, weigh most ("boundary-focused"); the keep share is fixed at training (0.25).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from tqdm import tqdm

from ..calibration import calibration_runner
from ..methods.base import Observation
from ..methods.kvpop import delayed_features, lookahead_mass
from ..methods.kvzap import token_features
from ..observation import observe

BOOST = 4.0  # extra weight of a token at the keep boundary (inferred)


def future_mass(obs: Observation, window: int, block: int = 128) -> Tensor:
    """[B, Hkv, S] the attention each held entry receives from the observed queries at least ``window`` positions
    after it, summed over the GQA group and the queries, ``block`` queries at a time."""
    B, Hkv, S, _ = obs.keys.shape
    out = torch.zeros(B, Hkv, S, device=obs.keys.device)
    for start in range(0, obs.queries.shape[2], block):
        slots = slice(start, start + block)
        attn = obs.window_attention(slots)  # [B, Hq, b, S], 0 where a query does not see a key
        later = obs.positions[:, :, None, :] + window <= obs.query_positions[:, slots][:, None, :, None]
        attn = attn.reshape(B, Hkv, -1, attn.shape[2], S) * later[:, :, None]
        out += attn.sum((2, 3))
    return out


def labels(mass: Tensor, candidates: Tensor, keep: float) -> tuple[Tensor, Tensor]:
    """(keep labels, loss weights), each [..., S], of the future ``mass`` [..., S] among ``candidates`` [..., S]
    (elsewhere label 0, weight 0): the top ``keep`` share are kept; a token's weight grows near the cut."""
    n = candidates.sum(-1, keepdim=True)
    rank = mass.masked_fill(~candidates, float("-inf")).argsort(-1, descending=True).argsort(-1).float()
    cut = (keep * n).floor()
    label = (rank < cut) & candidates
    weight = (1 + BOOST * torch.exp(-(rank - cut).abs() / (0.05 * n).clamp_min(1))) * candidates
    return label.float(), weight


@torch.no_grad()
def kvpop_examples(cm, texts: list[list[int]], per_context: int, seed: int, progress: bool = True,
                   window: int = 32, keep: float = 0.25, delay: int = 0) -> dict[str, Tensor]:
    """{"x": features [L, Hkv, N, F], "y": keep labels [L, Hkv, N], "w": loss weights [L, Hkv, N]} of up to
    ``per_context`` random candidate tokens of each context, from ``cm`` (a ``CompressedModel`` of the model).
    ``delay`` > 0: the delayed scorer's features, with the attention of the ``delay`` queries after each token
    (``methods.kvpop.lookahead_mass``; complete for every candidate while ``delay <= window``)."""
    if not 0 <= delay <= window:
        raise ValueError(f"kvpop: the delay must lie in [0, window={window}], got {delay}")
    runner = calibration_runner(cm, window=max(len(t) for t in texts))
    g = torch.Generator().manual_seed(seed)
    xs, ys, ws = [], [], []
    for ids in tqdm(texts, desc="KVpop targets", unit="context", disable=not progress, file=sys.stderr):
        runner.reset()
        runner.prefill(torch.tensor([ids], device=runner.device), compress=False, logits="last")
        feats, ys_c, ws_c, chosen = [], [], [], None
        for layer in runner.programs.layers:
            obs = observe(runner.cache, layer)
            candidates = obs.valid & (obs.positions + window <= obs.query_positions.amax(-1)[:, None, None])
            y, w = labels(future_mass(obs, window), candidates, keep)
            if chosen is None:
                usable = candidates[0].all(0).nonzero()[:, 0]
                chosen = usable[torch.randperm(len(usable), generator=g)[:per_context].sort().values]
            x = (delayed_features(obs.keys, obs.values, lookahead_mass(obs, delay)) if delay
                 else token_features(obs.keys, obs.values))
            feats.append(x[0][:, chosen].cpu())
            ys_c.append(y[0][:, chosen].cpu())
            ws_c.append(w[0][:, chosen].cpu())
        xs.append(torch.stack(feats))
        ys.append(torch.stack(ys_c))
        ws.append(torch.stack(ws_c))
    return {"x": torch.cat(xs, 2), "y": torch.cat(ys, 2), "w": torch.cat(ws, 2)}


def weighted_bce(data: dict[str, Tensor]):
    """The loss over the minibatch ``indices`` of the examples: boundary-weighted cross-entropy on keep labels."""
    x, y, w = data["x"], data["y"], data["w"]

    def loss(net, indices):
        logits = net(x[:, :, indices])
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[:, :, indices], reduction="none")
        return (bce * w[:, :, indices]).sum() / w[:, :, indices].sum().clamp_min(1e-12)
    return loss


def auc(predicted: Tensor, label: Tensor) -> float:
    """Mean over (layer, KV head) of the ROC AUC of ``predicted`` [L, Hkv, N] for the keep ``label`` [L, Hkv, N]
    (the chance that a kept token scores above a dropped one; ties count half)."""
    rank = predicted.argsort(-1).argsort(-1).double() + 1
    pos = label.bool()
    n_pos, n_neg = pos.sum(-1).double(), (~pos).sum(-1).double()
    u = (rank * pos).sum(-1) - n_pos * (n_pos + 1) / 2
    return float((u / (n_pos * n_neg).clamp_min(1)).mean())
