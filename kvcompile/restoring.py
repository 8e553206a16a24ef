"""The restore pass (``methods.sources.Restore``): learned embeddings read the whole cache, once, through
the source model with a LoRA adapter on, and their keys and values become ordinary cache entries.

The captured programs read token ids and know no adapter, so the pass runs the source model (a transformers causal
LM) densely: every layer's held keys and values become its ``DynamicCache`` (they are stored after RoPE, as
transformers stores them), the embeddings are its ``inputs_embeds`` at the positions after each row's context, and
``PagedKVCache.append_entries`` writes the new keys and values where the next tokens go. The cache must still hold
every token it read, in every head: the pass runs before the compression.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from .adapters import Adapter
from .cache import PagedKVCache


@torch.no_grad()
def restore(cache: PagedKVCache, source: nn.Module, embeddings: Tensor, adapter: dict[str, Tensor]) -> Tensor:
    """Append one entry per row of ``embeddings`` [n, hidden] to every (layer, row, KV head), computed by ``source``
    with ``adapter`` (``Adapter`` tensors) hooked in; returns [B] the position of each row's first restore entry."""
    if not bool((cache.lengths == cache.seen.to(cache.lengths)[None, :, None]).all()):
        raise ValueError("the restore pass reads every token the cache read, but some were evicted earlier: read the "
                         "context in one prefill, before any compression")
    B, n, start = cache.batch_size, embeddings.shape[0], cache.seen.clone()
    S = int(start.max())
    source_index = torch.arange(S, device=start.device) - (S - start)[:, None]  # left-padded: index - position is
    real = source_index >= 0  # the same in every row, as transformers' masks (sliding windows) assume
    past = DynamicCache()  # full layers: a sliding one would cut the restore rows
    for layer in range(cache.num_layers):
        keys, values, _, _ = cache.dense(layer)
        at = source_index.clamp_min(0)[:, None, :, None].expand(B, keys.shape[1], S, keys.shape[-1])
        past.update(keys.gather(2, at), values.gather(2, at), layer)
    mask = torch.cat([real, real.new_ones(B, n)], 1).long()
    weight = next(source.parameters())
    inputs = embeddings.to(weight).expand(B, n, -1)
    with Adapter.from_tensors(source, adapter).to(weight.device).installed(source):
        positions = start[:, None] + torch.arange(n, device=start.device)
        source(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, cache=past, use_cache=True)
    new = [(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in past.layers]
    cache.append_entries(*(torch.stack(x) for x in zip(*new)))
    return start
