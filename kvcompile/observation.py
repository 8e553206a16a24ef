"""What a method may read at compression time, supplied through one mechanism.

A method declares its sources (``methods.base.Source``: ``Scorer.sources``); ``check`` refuses, at ``apply``, any
source the runtime cannot supply yet; ``observe`` builds a layer's ``Observation`` from the cache (held keys,
values and positions; the observation ring's queries) and the supplied extras; ``reconstructing`` runs a
``Reconstruction`` source's prompt around one compression (KVzip).
"""

from __future__ import annotations

import contextlib

from torch import Tensor

from .cache import PagedKVCache
from .methods import Observation
from .methods.base import QueryWindow, Reconstruction, Source
from .spec import LayerSpec

SUPPLIED = (QueryWindow, Reconstruction)


def check(sources: tuple[Source, ...], who: str) -> None:
    """Raise, naming the source, when ``who`` declares one the runtime does not supply."""
    for source in sources:
        if not isinstance(source, SUPPLIED):
            raise NotImplementedError(
                f"{who} reads {type(source).__name__}, which kvcompile does not supply yet "
                f"(supplied: {', '.join(s.__name__ for s in SUPPLIED)})"
            )


def window(sources: tuple[Source, ...]) -> int:
    """Queries per layer the observation ring must keep for these sources."""
    return max((s.size for s in sources if isinstance(s, QueryWindow)), default=0)


def observe(cache: PagedKVCache, layer: LayerSpec) -> Observation:
    """Layer ``layer`` of the cache as a method sees it (dense per-head views plus the ring's queries)."""
    keys, values, positions, valid = cache.dense(layer.index)
    ring = cache.ring
    return Observation(
        keys, values, positions, valid, ring.queries[layer.index], ring.positions, layer.scale, layer.window,
        layer.index, cache.num_layers,
    )


@contextlib.contextmanager
def reconstructing(scorer, prefill, cache: PagedKVCache, input_ids: Tensor | None, real: Tensor | None):
    """Around one compression: when ``scorer`` declares a ``Reconstruction``, prefill its prompt for the tokens just
    read (``input_ids``, ``real`` [B, T]) with the ring cleared, so the window holds the prompt's queries alone;
    afterwards drop the prompt's tokens (``PagedKVCache.drop_from``). ``prefill(ids, real)`` runs one prefill step."""
    if input_ids is None or not any(isinstance(s, Reconstruction) for s in scorer.sources()):
        yield
        return
    seen = cache.seen.clone()
    ids, mask = scorer.reconstruction_prompt(input_ids, real)
    cache.ring.clear()
    prefill(ids, mask.to(cache.device))
    yield
    cache.drop_from(seen)
