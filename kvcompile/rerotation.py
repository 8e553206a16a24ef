"""Key re-rotation (kvpress's KeyRerotationPress, ``Recipe.rerotate_keys``; docs/methods_wrappers.md): after an
eviction, every head's kept keys are rotated to contiguous positions, as if the evicted tokens had never been there.

kvpress moves the m-th kept key of a head to position m and the next query to the cache's length. Here the m-th of
a head's n kept keys moves to ``seen - n + m``, right before the next query, whose position does not move. RoPE
logits depend only on the distance between query and key, and those distances are kvpress's, so attention is the
same; but query positions stay one per token, which ragged heads (each with its own n) need. Rotations compose, so
a model's RoPE scaling (``attention_scaling``, scaled frequencies) carries over.
"""

from __future__ import annotations

import torch

from .cache import PagedKVCache
from .methods.rope import rotate
from .spec import ModelSpec


def check(spec: ModelSpec, recipe, prefill_chunk: int | None) -> None:
    """Refuse, at ``apply``, a re-rotating recipe the runtime cannot serve exactly."""
    if not recipe.rerotate_keys:
        return
    if not spec.rotary:
        raise ValueError(f"recipe {recipe.name!r} re-rotates keys, but this model has no rotary embedding buffers "
                         "(inv_freq) that kvcompile can read")
    if recipe.decode is not None or prefill_chunk:
        raise ValueError(f"recipe {recipe.name!r} re-rotates keys after its one compression; it cannot be combined "
                         "with a decode schedule or prefill_chunk (later compressions would rank moved positions)")


def rerotate(cache: PagedKVCache, spec: ModelSpec) -> None:
    """Move every head's held keys to contiguous positions ending right before the row's next token."""
    for layer, inv_freq in enumerate(spec.rotary):
        keys, _, positions, valid = cache.dense(layer)
        n = valid.sum(-1, keepdim=True)
        rank = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(-1).argsort(-1)
        new = cache.seen[:, None, None] - n + rank
        moved = rotate(keys, (new - positions).masked_fill(~valid, 0), torch.tensor(inv_freq, device=keys.device))
        cache.rewrite(layer, keys=moved, positions=new)
