"""Transactional Attention (https://arxiv.org/abs/2604.11288; abstract only, so inferred): anchor
patterns in the context (``password:``, ``key:``, ``id:``) sponsor the value tokens after them, which no attention
score marks (credentials, IDs), out of a share of the budget the wrapped scorer cannot touch. TA-Fast ends a value
at a delimiter token; TA ends it where the value's own queries stop attending to the anchor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import (
    ContextTokens,
    Observation,
    QueryWindow,
    Source,
    Wrapper,
    at_positions,
    descending_rank,
    register_scorer,
)

UNRESOLVED = ("ta and ta-fast match their anchors on token ids, which depend on the tokenizer: resolve the recipe "
              "first with kvcompile.recipes.anchors.resolve(recipe, tokenizer), or give anchors= as id sequences")


@dataclass
class Sponsoring(Wrapper):
    """What TA and TA-Fast share: the tokens after every occurrence of an ``anchors`` id sequence, at most ``span``
    and ending before the first of the variant's ``stops``, are sponsored. Any top-k of the ranking holds the first
    ~``share``*k sponsored tokens in context order and the base's top ~(1 - share)*k (its pinned tokens first); a
    share the sponsored tokens do not fill goes back to the base.

    Inferred (the paper was not read): the span rule, the share (default 0.25) and its spending in context order;
    allow-listing is choosing ``anchors``. The scores returned are the merged ranking (the same values in every
    head), not the base's scale, and nothing is pinned: ``share`` bounds sponsorship at any budget, even one the
    base's pins would fill alone."""

    anchors: list | None = None  # token-id sequences; None: not resolved for a tokenizer yet
    span: int = 16
    share: float = 0.25

    def __post_init__(self):
        if self.anchors is None:
            raise ValueError(UNRESOLVED)
        if any(not seq or any(not isinstance(i, int) or i < 0 for i in seq) for seq in self.anchors):
            raise ValueError(f"{self.name}: every anchor must be a non-empty sequence of token ids, got "
                             f"{self.anchors!r}")
        if self.span < 1 or not 0.0 < self.share < 1.0:
            raise ValueError(f"{self.name}: need span >= 1 and 0 < share < 1, got span={self.span}, share={self.share}")
        super().__post_init__()

    def sources(self) -> tuple[Source, ...]:
        return tuple(dict.fromkeys(self._base.sources() + (ContextTokens(),)))

    def score(self, obs: Observation) -> Tensor:
        base = self._base.score(newest_queries(obs, self._base.observation_window)).float()
        base = base.masked_fill(~obs.valid, float("-inf"))
        ids = position_ids(obs)
        starts, anchor_tokens = find_anchors(ids, self.anchors)
        sponsored = spans(starts, self.stops(obs, ids, starts, anchor_tokens), self.span)
        return sponsor_first(base, at_positions(sponsored, obs) & obs.valid, obs.positions,
                             self.share).masked_fill(~obs.valid, float("-inf"))

    def stops(self, obs: Observation, ids: Tensor, starts: Tensor, anchor_tokens: Tensor) -> Tensor:
        """[B, P] the positions that end a value (not sponsored themselves)."""
        raise NotImplementedError


@register_scorer("ta-fast")
@dataclass
class TransactionalFast(Sponsoring):
    """TA-Fast, lexical: a value ends before the first ``delimiters`` id."""

    delimiters: list | tuple = ()  # token ids that end a value

    def stops(self, obs: Observation, ids: Tensor, starts: Tensor, anchor_tokens: Tensor) -> Tensor:
        return torch.isin(ids, torch.tensor(list(self.delimiters), dtype=ids.dtype, device=ids.device))


@register_scorer("ta")
@dataclass
class TransactionalAttention(Sponsoring):
    """TA: a value ends at the first token after the anchor whose own query pays the anchor's tokens less than
    ``link`` of its attention (mean over the layer's query heads; ``anchor_link``). It reads every prompt query (up
    to ``window``), which TA-Fast does not: the memory the paper's TA-Fast saves.

    Inferred: the paper's attention rule is not in its abstract; "the anchor's own query attends to the value"
    cannot hold causally, so the value's queries attending to the anchor stand for it; ``link`` 0.02, read off one
    SmolLM2 credential context (the values' links are 0.02 to 0.2 in most layers, noisy; docs/methods_scorers.md)."""

    link: float = 0.02
    window: int = 8192

    def __post_init__(self):
        if not 0.0 <= self.link <= 1.0 or self.window < 1:
            raise ValueError(f"ta: need 0 <= link <= 1 and window >= 1, got link={self.link}, window={self.window}")
        super().__post_init__()

    @property
    def observation_window(self) -> int:
        return max(self._base.observation_window, self.window)

    def sources(self) -> tuple[Source, ...]:
        others = tuple(s for s in self._base.sources() if not isinstance(s, QueryWindow))
        return others + (QueryWindow(self.observation_window), ContextTokens())

    def stops(self, obs: Observation, ids: Tensor, starts: Tensor, anchor_tokens: Tensor) -> Tensor:
        longest = max((len(seq) for seq in self.anchors), default=1)
        return anchor_link(obs, starts, anchor_tokens, longest) < self.link


def newest_queries(obs: Observation, n: int) -> Observation:
    """``obs`` with only its ``n`` newest observed queries (the others marked absent, -1): what a base scorer reads
    when its wrapper observes more (TA reads every prompt query, SnapKV its last 32)."""
    qp = obs.query_positions
    return dataclasses.replace(obs, query_positions=qp.masked_fill(qp <= qp.amax(-1, keepdim=True) - n, -1))


def position_ids(obs: Observation) -> Tensor:
    """[B, P] the token id at every original position some head holds, -1 where none does (heads hold different
    tokens after an earlier compression, and meet by position)."""
    B = obs.positions.shape[0]
    pos = obs.positions.masked_fill(~obs.valid, 0).reshape(B, -1)
    ids = obs.token_ids.masked_fill(~obs.valid, -1).reshape(B, -1)
    table = torch.full((B, int(pos.max()) + 1), -1, dtype=ids.dtype, device=ids.device)
    return table.scatter_reduce_(1, pos, ids, "amax")


def find_anchors(ids: Tensor, anchors: list) -> tuple[Tensor, Tensor]:
    """[B, P] the positions right after an occurrence of an ``anchors`` id sequence in ``ids`` [B, P] (where a value
    starts), and [B, P] the positions of the anchors' own tokens."""
    B, P = ids.shape
    starts = torch.zeros(B, P, dtype=torch.bool, device=ids.device)
    tokens = torch.zeros(B, P, dtype=torch.bool, device=ids.device)
    for seq in anchors:
        m = len(seq)
        if m >= P:
            continue
        found = (ids.unfold(1, m, 1)[:, : P - m] == torch.tensor(seq, device=ids.device)).all(-1)  # [B, P - m]
        starts[:, m:] |= found
        for j in range(m):
            tokens[:, j : P - m + j] |= found
    return starts, tokens


def spans(starts: Tensor, stops: Tensor, span: int) -> Tensor:
    """[B, P] True at the sponsored tokens: from a value's start, at most ``span`` tokens, ending before the first
    of ``stops`` [B, P]; a later start begins a new span."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    last_start = torch.where(starts, index, -1).cummax(1).values
    last_stop = torch.where(stops, index, -1).cummax(1).values
    return (last_start >= 0) & (index - last_start < span) & (last_stop < last_start)


def anchor_link(obs: Observation, starts: Tensor, anchor_tokens: Tensor, longest: int) -> Tensor:
    """[B, P] the attention each observed query pays the tokens of the anchor its value follows (the anchor tokens
    among the ``longest`` positions before the latest value start), mean over query heads; 0 where no query was
    observed or no anchor came before."""
    B, P = starts.shape
    index = torch.arange(P, device=starts.device).expand(B, P)
    last_start = torch.where(starts, index, -1).cummax(1).values
    qp = obs.query_positions
    seen = (qp >= 0) & (qp < P)
    start = torch.where(seen, last_start.gather(1, qp.clamp(0, P - 1)), -1)  # [B, W]
    kp = obs.positions.clamp(0, P - 1)
    is_anchor = anchor_tokens.gather(1, kp.flatten(1)).view_as(kp) & obs.valid  # [B, Hkv, S]
    G = obs.queries.shape[1] // obs.keys.shape[1]
    link = torch.zeros(B, P, device=starts.device)
    for queries in obs.query_blocks(256):
        s = start[:, queries][:, None, :, None]  # [B, 1, w, 1]
        near = is_anchor[:, :, None, :] & (kp[:, :, None, :] < s) & (kp[:, :, None, :] >= s - longest)
        mass = (obs.window_attention(queries) * near.repeat_interleave(G, 1)).sum(-1).mean(1)  # [B, w]
        mass = mass.masked_fill(start[:, queries] < 0, 0.0)
        link.scatter_reduce_(1, qp[:, queries].clamp(0, P - 1), mass, "amax")
    return link


def sponsor_first(base: Tensor, sponsored: Tensor, positions: Tensor, share: float) -> Tensor:
    """One ranking [..., S] from the base's scores and the sponsored tokens: a token ranks by min((rank in base + 1)
    / (1 - share), (rank among the sponsored by position + 1) / share), so any top k holds the first ~share*k
    sponsored and the base's top ~(1 - share)*k; unsponsored tokens enter by the base alone."""
    by_base = (descending_rank(base).float() + 1) / (1 - share)
    earliest = torch.where(sponsored, -positions.float(), float("-inf"))
    by_sponsor = torch.where(sponsored, (descending_rank(earliest).float() + 1) / share, float("inf"))
    return -torch.minimum(by_base, by_sponsor)
