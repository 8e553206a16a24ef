"""Transactional Attention's TA-Fast (https://arxiv.org/abs/2604.11288, METHODS §59; abstract only, so inferred):
anchor patterns in the context (``password:``, ``key:``, ``id:``) sponsor the value tokens after them, which no
attention score marks (credentials, IDs), out of a share of the budget the wrapped scorer cannot touch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import ContextTokens, Observation, Source, Wrapper, at_positions, descending_rank, register_scorer

UNRESOLVED = ("ta-fast matches its anchors on token ids, which depend on the tokenizer: resolve the recipe first "
              "with kvcompile.recipes.anchors.resolve(recipe, tokenizer), or give anchors= as id sequences")


@register_scorer("ta-fast")
@dataclass
class TransactionalFast(Wrapper):
    """Lexical sponsorship (TA-Fast): the ``span`` tokens after every occurrence of an ``anchors`` id sequence,
    cut before the first ``delimiters`` id, are sponsored. Any top-k of the ranking holds the first ~``share``*k
    sponsored tokens in context order and the base's top ~(1 - share)*k (its pinned tokens first); a share the
    sponsored tokens do not fill goes back to the base.

    Inferred (the paper was not read): the span and delimiter rule, the share (default 0.25) and its spending in
    context order; allow-listing is choosing ``anchors``. The scores returned are the merged ranking (the same
    values in every head), not the base's scale, and nothing is pinned: ``share`` bounds sponsorship at any
    budget, even one the base's pins would fill alone."""

    anchors: list | None = None  # token-id sequences; None: not resolved for a tokenizer yet
    delimiters: list | tuple = ()  # token ids that end a value
    span: int = 16
    share: float = 0.25

    def __post_init__(self):
        if self.anchors is None:
            raise ValueError(UNRESOLVED)
        if any(not seq or any(not isinstance(i, int) or i < 0 for i in seq) for seq in self.anchors):
            raise ValueError(f"ta-fast: every anchor must be a non-empty sequence of token ids, got {self.anchors!r}")
        if self.span < 1 or not 0.0 < self.share < 1.0:
            raise ValueError(f"ta-fast: need span >= 1 and 0 < share < 1, got span={self.span}, share={self.share}")
        super().__post_init__()

    def sources(self) -> tuple[Source, ...]:
        return tuple(dict.fromkeys(self._base.sources() + (ContextTokens(),)))

    def score(self, obs: Observation) -> Tensor:
        base = self._base.score(obs).float().masked_fill(~obs.valid, float("-inf"))
        sponsored = at_positions(sponsored_positions(position_ids(obs), self.anchors, self.delimiters, self.span),
                                 obs) & obs.valid
        return sponsor_first(base, sponsored, obs.positions, self.share).masked_fill(~obs.valid, float("-inf"))


def position_ids(obs: Observation) -> Tensor:
    """[B, P] the token id at every original position some head holds, -1 where none does (heads hold different
    tokens after an earlier compression, and meet by position)."""
    B = obs.positions.shape[0]
    pos = obs.positions.masked_fill(~obs.valid, 0).reshape(B, -1)
    ids = obs.token_ids.masked_fill(~obs.valid, -1).reshape(B, -1)
    table = torch.full((B, int(pos.max()) + 1), -1, dtype=ids.dtype, device=ids.device)
    return table.scatter_reduce_(1, pos, ids, "amax")


def sponsored_positions(ids: Tensor, anchors: list, delimiters, span: int) -> Tensor:
    """[B, P] True at the tokens an anchor sponsors in ``ids`` [B, P]: from the token after an anchor, at most
    ``span`` tokens, ending before the first delimiter; a later anchor starts a new span."""
    B, P = ids.shape
    starts = torch.zeros(B, P, dtype=torch.bool, device=ids.device)
    for seq in anchors:
        m = len(seq)
        if m >= P:
            continue
        found = (ids.unfold(1, m, 1)[:, : P - m] == torch.tensor(seq, device=ids.device)).all(-1)  # [B, P - m]
        starts[:, m:] |= found
    index = torch.arange(P, device=ids.device).expand(B, P)
    last_start = torch.where(starts, index, -1).cummax(1).values
    ends = torch.isin(ids, torch.tensor(list(delimiters), dtype=ids.dtype, device=ids.device))
    last_end = torch.where(ends, index, -1).cummax(1).values
    return (last_start >= 0) & (index - last_start < span) & (last_end < last_start)


def sponsor_first(base: Tensor, sponsored: Tensor, positions: Tensor, share: float) -> Tensor:
    """One ranking [..., S] from the base's scores and the sponsored tokens: a token ranks by min((rank in base + 1)
    / (1 - share), (rank among the sponsored by position + 1) / share), so any top k holds the first ~share*k
    sponsored and the base's top ~(1 - share)*k; unsponsored tokens enter by the base alone."""
    by_base = (descending_rank(base).float() + 1) / (1 - share)
    earliest = torch.where(sponsored, -positions.float(), float("-inf"))
    by_sponsor = torch.where(sponsored, (descending_rank(earliest).float() + 1) / share, float("inf"))
    return -torch.minimum(by_base, by_sponsor)
