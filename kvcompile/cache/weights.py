"""The weight channel of the paged cache: a log-weight per pool row, for recipes that write weighted entries.

An entry with log-weight ``log w`` stands for w tokens with its key: attention adds ``log w`` to its logit, so it
gets w times the mass of a plain token (a summary, ``plan.NewEntries``). The channel is ``page_lw`` [N, P] float32,
beside ``page_pos`` and moved with it (written by ``keep`` alone, compacted, renumbered, zeroed past each head's
length), allocated only for a cache made ``weighted`` (the recipe writes weighted entries); otherwise it is [0, P],
and attention, which selects its path from that shape, never reads it. A new token's row is zero (the isolation
invariant), which is log-weight 0: weight 1. Its bytes are part of every page of a weighted cache (``page_bytes``).
Weighted entries live in the model-dtype pool only; a page format beside them is refused at ``apply``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import reference


class WeightChannel:
    """The log-weight channel of ``PagedKVCache`` (mixed into it)."""

    def _empty_weights(self, pages: int) -> None:
        """A zero channel for ``pages`` pool pages ([0, P] for a cache that is not ``weighted``)."""
        self.page_lw = torch.zeros(pages if self.weighted else 0, self.page_size, device=self.device)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the model-dtype pool; log-weights stay float32 (a narrow float would round log w)."""
        saved = self.page_lw
        super()._apply(fn, recurse)
        self.page_lw = saved.to(self.k_pages.device)
        return self

    def set_weighted(self, weighted: bool) -> None:
        """Give the cache a weight channel (a ``fork`` to a recipe that writes weighted entries), or drop it;
        dropping it is refused while a held entry carries a weight."""
        if weighted == self.weighted:
            return
        if self.weights_used:
            raise ValueError("this cache holds weighted entries; a recipe without them must prefill on its own")
        self.weighted = weighted
        self._empty_weights(self.k_pages.shape[0])

    @property
    def weights_used(self) -> bool:
        """Whether any held entry has a log-weight other than 0 (a host sync: compression paths only)."""
        return bool(self.page_lw.any())

    def log_weights(self, layer: int) -> Tensor | None:
        """[B, Hkv, S] log-weight of each entry of ``dense(layer)`` (0 past a head's length); None for a cache
        without a weight channel."""
        if not self.weighted:
            return None
        return reference.gather_pages(self.page_lw, self.page_table[layer])
