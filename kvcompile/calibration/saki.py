"""SAKI's calibration and recall report (``methods.saki``; METHODS.md §20): each (layer, KV head)'s pre-RoPE query
and key moments from a model's own prefill, and the top-k recall of its rank-r index against key PCA at equal rank.

The paper's protocol, here: calibrate on some text, then on other text take the last ``n_queries`` queries of
each head, score every key they may see (causal) exactly and through the index (pre-RoPE key, mapped, rotated back
to its position), and count how many of the exact top-k the index's top-k recovers. A GQA group's queries share
their KV head's index.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..methods.saki import LowRankKeys, key_pca, moments, saki, topk_recall
from ..observation import observe
from ..methods.rope import rotate
from . import calibration_runner


@torch.no_grad()
def _heads(model, ids: Tensor):
    """Per layer: (queries [Hkv, G*W, D], query positions [Hkv, G*W], keys [Hkv, S, D], positions [Hkv, S]), all
    post-RoPE, of one prompt ``ids`` [1, T] read uncompressed."""
    runner = calibration_runner(model, window=ids.shape[1])
    runner.prefill(ids.to(runner.device), compress=False, logits="last")
    out = []
    for layer in runner.programs.layers:
        obs = observe(runner.cache, layer)
        Hkv, (_, Hq, W, D) = obs.keys.shape[1], obs.queries.shape
        queries = obs.queries[0].reshape(Hkv, Hq // Hkv * W, D).float()
        q_pos = obs.query_positions[0].repeat(Hq // Hkv)[None].expand(Hkv, -1)
        seen = q_pos >= 0
        out.append((queries[:, seen[0]], q_pos[:, seen[0]], obs.keys[0].float(),
                    obs.positions[0].masked_fill(~obs.valid[0], -1)))
    return out


def _unrotated(x: Tensor, positions: Tensor, inv_freq) -> Tensor:
    """Pre-RoPE rows of post-RoPE ``x`` [..., D] at ``positions`` (as is for a model without rotary buffers)."""
    return rotate(x, -positions.clamp_min(0), torch.tensor(inv_freq)) if inv_freq else x


def calibrate(model, samples: list[Tensor]) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """[L][Hkv] (Σq, Σk, μ) of a ``CompressedModel``'s pre-RoPE queries and keys over the calibration ``samples``
    (input_ids [1, T] each), every token of every sample."""
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    rows: list[list[tuple[list, list]]] = []
    for ids in samples:
        for layer, ((q, q_pos, k, pos), inv_freq) in enumerate(zip(_heads(model, ids), rotary)):
            if len(rows) <= layer:
                rows.append([([], []) for _ in range(k.shape[0])])
            for h, (queries, keys) in enumerate(rows[layer]):
                valid = pos[h] >= 0
                queries.append(_unrotated(q[h], q_pos[h], inv_freq))
                keys.append(_unrotated(k[h][valid], pos[h][valid], inv_freq))
    return [[moments(torch.cat(q), torch.cat(k)) for q, k in layer] for layer in rows]


def recall(model, stats, samples: list[Tensor], ranks: list[int], k: int = 64, n_queries: int = 512) -> list[dict]:
    """Top-``k`` recall of SAKI and of key PCA at each rank, per (layer, KV head), on ``samples`` (text other than
    the calibration's): one row per (method, rank, layer, head) with ``recall`` averaged over the last
    ``n_queries`` queries of each sample (those that may see at least ``k`` keys)."""
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    sums: dict[tuple, list[float]] = {}
    for ids in samples:
        for layer, ((q, q_pos, keys, pos), inv_freq) in enumerate(zip(_heads(model, ids), rotary)):
            for h in range(keys.shape[0]):
                last = q_pos[h] >= int(q_pos[h].max()) - n_queries + 1
                queries, qp = q[h][last], q_pos[h][last]
                valid = (pos[h][None] >= 0) & (pos[h][None] <= qp[:, None])
                exact = queries @ keys[h].T
                pre = _unrotated(keys[h], pos[h], inv_freq).double()
                sigma_q, sigma_k, mean = stats[layer][h]
                for rank in ranks:
                    for name, maps in (("saki", saki(sigma_q, sigma_k, mean, rank)[0]),
                                       ("pca", key_pca(sigma_k, mean, rank))):
                        approx = queries @ _rotated(maps, pre, pos[h], inv_freq).T
                        sums.setdefault((name, rank, layer, h), []).append(float(topk_recall(exact, approx, k, valid)))
    return [{"method": m, "rank": r, "layer": layer, "head": h, "recall": sum(v) / len(v)}
            for (m, r, layer, h), v in sums.items()]


def _rotated(maps: LowRankKeys, pre: Tensor, positions: Tensor, inv_freq) -> Tensor:
    """The index's keys, post-RoPE: each pre-RoPE key mapped (``reconstruct``) and rotated back to its position."""
    keys = maps.reconstruct(pre).float()
    return rotate(keys, positions.clamp_min(0), torch.tensor(inv_freq)) if inv_freq else keys
