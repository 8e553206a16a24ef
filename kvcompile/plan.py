"""The one plan type of every compression: which entries each head keeps, and what new entries it writes.

Prefill compression (``compress``) and decode-time schedules (``schedule``) both end in a ``Plan``, and
``PagedKVCache.keep`` is the one function that applies it. Shape letters: L layers, B rows, Hkv KV heads, K entries
kept per head at most, E new entries per head at most, D head dim.

Protection is explicit: every held token has a level, and a head keeps higher levels first, then higher scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# protection levels: a higher level is kept first (``select``); -1 marks a slot that holds nothing
RECENT, SINK, PINNED, PROMPT, SCORED = 4, 3, 2, 1, 0
EMPTY = -1
DTYPE_FORMAT, STORED_FORMAT = 0, 1  # the pools of a plan's ``formats``: the model's dtype, the cache's page format


@dataclass
class NewEntries:
    """Entries a plan writes after a head's kept ones (summaries, merged or synthetic entries).

    keys, values [L, B, Hkv, E, D]; positions [L, B, Hkv, E]; counts [L, B, Hkv] how many of the E each head
    writes; log_weights [L, B, Hkv, E]: an entry's attention logit gets + log w, so it stands for w tokens with its
    key (0 = an ordinary token; others need a cache with a weight channel, ``cache.weights``)."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    counts: Tensor
    log_weights: Tensor | None = None

    def __post_init__(self):
        if self.log_weights is None:
            self.log_weights = torch.zeros(self.positions.shape, device=self.positions.device)


@dataclass
class AnchoredEntries:
    """An anchored format's encoding of every entry a plan keeps (``kernels.anchored``): rows [L, B, Hkv, K, 2, 3]
    int16 (each kept entry's key and value row, in ``keep``'s order), anchors [L, 2, B, Hkv, 1 + A, D] and residuals
    [L, 2, B, R, W]: the tables the rows decode against."""

    rows: Tensor
    anchors: Tensor
    residuals: Tensor


@dataclass
class Plan:
    """What every head holds after a compression.

    keep [L, B, Hkv, K]: logical indices of the entries kept, ascending in each head's first ``counts`` [L, B, Hkv]
    (the rest is ignored); formats [L, B, Hkv, K]: the pool of each kept entry, ``DTYPE_FORMAT`` or
    ``STORED_FORMAT`` (None: each stays where it is; a formatted plan also stores ``new`` in the format); new:
    entries written after the kept ones (None: none). A head then holds ``counts + new.counts`` entries, kept ones
    first, in their old order. channels [L, B, Hkv, W]: for a page format that drops key channels, the ones each
    head keeps, ascending (None: those it keeps now). anchored: every kept entry as an anchored format's rows, with
    their tables (``PageFormat.anchored``; None for any other format)."""

    keep: Tensor
    counts: Tensor
    formats: Tensor | None = None
    new: NewEntries | None = None
    channels: Tensor | None = None
    anchored: AnchoredEntries | None = None

    @property
    def lengths(self) -> Tensor:
        """[L, B, Hkv] entries each head holds once the plan is applied."""
        return self.counts if self.new is None else self.counts + self.new.counts.to(self.counts.dtype)

    def kept(self, S: int) -> Tensor:
        """[L, B, Hkv, S] True at the logical indices (below S) of the entries this plan keeps."""
        live = (torch.arange(self.keep.shape[-1], device=self.keep.device) < self.counts[..., None]).long()
        index = self.keep.clamp_max(S - 1)  # past counts: padding, never live
        mask = torch.zeros(*self.counts.shape, S, dtype=torch.long, device=self.keep.device)
        return mask.scatter_reduce(-1, index, live, "amax").bool()

    @classmethod
    def of_mask(cls, kept: Tensor, **fields) -> Plan:
        """The plan that keeps the ``kept`` [L, B, Hkv, S] entries."""
        return cls(kept_indices(kept), kept.sum(-1), **fields)


def padded(mask: Tensor, S: int) -> Tensor:
    """A [..., S'] mask of held entries cut or padded (False) to S entries."""
    return torch.nn.functional.pad(mask, (0, max(S - mask.shape[-1], 0)))[..., :S]


def kept_indices(kept: Tensor) -> Tensor:
    """Logical indices [..., K] of the ``kept`` [..., S] entries, ascending; K is the most any head keeps (>= 1)."""
    S = kept.shape[-1]
    idx = torch.arange(S, device=kept.device).expand_as(kept)
    K = max(int(kept.sum(-1).max()), 1)
    return torch.where(kept, idx, S).sort(-1).values[..., :K]


def rank(scores: Tensor, levels: Tensor | None = None) -> Tensor:
    """Rank [..., S] of every entry (0 = kept first): by level, then by score, then by position."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    if levels is not None:
        order = order.gather(-1, levels.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    return order.argsort(dim=-1)


def select(scores: Tensor, counts: Tensor, levels: Tensor | None = None, **fields) -> Plan:
    """The plan keeping each head's ``counts`` [...] best entries of ``scores`` [..., S] (``rank``)."""
    return Plan.of_mask(rank(scores, levels) < counts[..., None], **fields)


def pinned_levels(scores: Tensor, pinned: Tensor) -> Tensor:
    """Levels of prefill scores [..., S]: PINNED where a scorer pinned a token (``pinned``, what
    ``methods.base.protect`` marked), SCORED for the rest, EMPTY where nothing is held (-inf)."""
    level = torch.where(pinned, PINNED, SCORED)
    return level.masked_fill(scores == float("-inf"), EMPTY)
