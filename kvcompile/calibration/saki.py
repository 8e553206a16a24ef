"""SAKI's calibration and recall report (``methods.saki``; docs/methods_formats.md#saki): each (layer, KV head)'s
pre-RoPE query and key moments from a model's own prefill, and the top-k recall of its rank-r index against key PCA at
equal rank.

The paper's protocol, here: calibrate on some text, then on other text take the last ``n_queries`` queries of
each head, score every key they may see (causal) exactly and through the index (pre-RoPE key, mapped, rotated back
to its position), and count how many of the exact top-k the index's top-k recovers. A GQA group's queries share
their KV head's index.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..methods.rope import rotate
from ..methods.saki import LowRankKeys, key_pca, moments, saki, topk_recall
from . import prefill_heads, unrotated


def calibrate(model, samples: list[Tensor]) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """[L][Hkv] (Σq, Σk, μ) of a ``CompressedModel``'s pre-RoPE queries and keys over the calibration ``samples``
    (input_ids [1, T] each), every token of every sample."""
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    rows: list[list[tuple[list, list]]] = []
    for ids in samples:
        for layer, ((q, q_pos, k, _, pos), inv_freq) in enumerate(zip(prefill_heads(model, ids), rotary)):
            if len(rows) <= layer:
                rows.append([([], []) for _ in range(k.shape[0])])
            for h, (queries, keys) in enumerate(rows[layer]):
                valid = pos[h] >= 0
                queries.append(unrotated(q[h], q_pos[h], inv_freq))
                keys.append(unrotated(k[h][valid], pos[h][valid], inv_freq))
    return [[moments(torch.cat(q), torch.cat(k)) for q, k in layer] for layer in rows]


def recall(model, stats, samples: list[Tensor], ranks: list[int], k: int = 64, n_queries: int = 512) -> list[dict]:
    """Top-``k`` recall of SAKI and of key PCA at each rank, per (layer, KV head), on ``samples`` (text other than
    the calibration's): one row per (method, rank, layer, head) with ``recall`` averaged over the last
    ``n_queries`` queries of each sample (those that may see at least ``k`` keys)."""
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    sums: dict[tuple, list[float]] = {}
    for ids in samples:
        for layer, ((q, q_pos, keys, _, pos), inv_freq) in enumerate(zip(prefill_heads(model, ids), rotary)):
            for h in range(keys.shape[0]):
                last = q_pos[h] >= int(q_pos[h].max()) - n_queries + 1
                queries, qp = q[h][last], q_pos[h][last]
                valid = (pos[h][None] >= 0) & (pos[h][None] <= qp[:, None])
                exact = queries @ keys[h].T
                pre = unrotated(keys[h], pos[h], inv_freq).double()
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
