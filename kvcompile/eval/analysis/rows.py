"""Attention rows of a real model, read (never written) from a prefilled full cache.

A full-budget model whose observation ring keeps the last ``window`` queries (the oracle probe, as in
``fidelity``) prefills offline prose (``pydoc_data``); per layer, ``observe`` gives the held keys and values and
the ring's post-RoPE queries, and ``Observation.window_attention`` the softmax rows over them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

import kvcompile

from ...model import CompressedModel
from ...observation import observe
from ...recipes import Recipe
from ..decoding import ids_tensor
from ..fidelity import prose_windows


@torch.no_grad()
def attention_rows(cm: CompressedModel, tokenizer, *, rows: int, contexts: int, length: int, window: int,
                   min_keys: int, seed: int = 0) -> Iterator[dict]:
    """About ``rows`` rows, spread evenly over ``contexts`` prose windows of ``length`` tokens and every layer,
    drawn at random among (query head, observed query) pairs that see at least ``min_keys`` keys.

    Yields one dict per (context, layer): ``layer``; ``head``, ``position`` [r]; ``a`` [r, S] attention weights
    (0 for keys the query does not see); ``V`` [r, S, D] the values of each row's KV head."""
    probe = kvcompile.apply(cm, budget=1.0, recipe=Recipe("ceiling-probe", "oracle", scorer_args={"window": window}))
    layers = probe.programs.layers
    per = math.ceil(rows / (contexts * len(layers)))
    gen = torch.Generator().manual_seed(seed)
    for ids in prose_windows(tokenizer, contexts, length, seed):
        probe.reset()
        probe.prefill(ids_tensor(ids, probe.device), compress=False, logits="last")
        for layer in layers:
            obs = observe(probe.cache, layer)
            attn = obs.window_attention()[0].cpu()  # [Hq, W, S]
            Hq, W, _ = attn.shape
            seen = ((attn > 0).sum(-1) >= min_keys).flatten().nonzero().squeeze(1)
            pick = seen[torch.randperm(len(seen), generator=gen)[:per]]
            head, q = pick // W, pick % W
            values = obs.values[0].cpu()[head // (Hq // obs.values.shape[1])]
            yield {"layer": layer.index, "head": head, "position": obs.query_positions[0, q].cpu(),
                   "a": attn[head, q], "V": values}
