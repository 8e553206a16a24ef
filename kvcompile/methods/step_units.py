"""Steps as retention units (INFERRED: the papers were not found, only one-line descriptions, so every
rule below is our reading of them): StepKV, CommitKV and ReCo rank the caller's segments (``Segments``: reasoning
steps, tool calls with their observations) as whole units and keep whole segments in that order; the budget's
remainder goes inside the first segment that does not fit, by token saliency. The segments holding the observed
queries (the current step) rank first, the newest first, as SnapKV keeps its window.

The ranking is one score per held entry: -(rank of its segment * S + rank of its saliency within the head), so any
top-k of a head keeps whole segments and at most one partial one, whatever k the allocator gives it. Segments rank
the same in every head (their utility is summed over heads), so every head keeps the same segments."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import (
    ContextTokens,
    Observation,
    QueryWindow,
    Scorer,
    Segments,
    Source,
    at_positions,
    descending_rank,
    pool_groups,
    position_sums,
    register_scorer,
)
from .transactional import find_anchors, position_ids


@dataclass
class StepUnits(Scorer):
    """What the step-level scorers share: token saliency (mean attention of the last ``window`` queries, pooled
    over each GQA group) and the ranking of whole segments by ``utility``."""

    window: int = 32

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1, got {self.window}")

    @property
    def observation_window(self) -> int:
        return self.window

    def sources(self) -> tuple[Source, ...]:
        return (QueryWindow(self.observation_window), Segments())

    def score(self, obs: Observation) -> Tensor:
        seg, K = segment_table(obs)
        recent = newest(obs, self.window)
        attn = obs.window_attention(recent).mean(2)  # [B, Hq, S] from the recent queries
        entry_seg = at_positions(seg, obs)  # [B, Hkv, S]
        utility = self.utility(obs, seg, K, attn)  # [B, K]
        current = segments_of_queries(obs, seg, K, recent)  # first, the newest first
        unit = torch.where(current, 1e12 + torch.arange(K, device=seg.device, dtype=torch.float64), utility.double())
        seg_rank = descending_rank(unit).gather(1, entry_seg.flatten(1)).view_as(entry_seg)
        saliency = pool_groups(attn, obs.keys.shape[1]).masked_fill(~obs.valid, float("-inf"))
        within = descending_rank(saliency)
        return -(seg_rank * obs.keys.shape[2] + within).float()

    def utility(self, obs: Observation, seg: Tensor, K: int, attn: Tensor) -> Tensor:
        """[B, K] how much each segment is worth keeping (higher first)."""
        raise NotImplementedError


@register_scorer("stepkv")
@dataclass
class StepKV(StepUnits):
    """StepKV (inferred): a step's utility is the attention mass the last ``window`` queries pay its tokens, summed
    over its tokens and every query head, per token it costs; steps rank by it as units, the borderline step is
    filled by token saliency."""

    def utility(self, obs: Observation, seg: Tensor, K: int, attn: Tensor) -> Tensor:
        return per_cost(segment_sums(position_sums(attn, obs), seg, K), obs, seg, K)


@register_scorer("reco")
@dataclass
class ReCo(StepUnits):
    """ReCo (inferred): StepKV's utility times a step reward. No process reward model is run: the cheap step-quality
    estimate (``reward="progress"``) is how much the queries of later steps (of the last ``horizon``) attend to the
    step, per query and per token of the step, scaled to [0, 1] by the best step; ``reward="constant"`` gives
    StepKV's ranking exactly.
    The reflection penalty (off by default) multiplies the reward of a step holding one of ``reflection`` (token-id
    sequences of "Wait", "let me check"...; ``recipes.steps.resolve`` spells them for a tokenizer) by
    ``1 - penalty``. ReCo's early stop is a generation option, not part of its compression
    (``kvcompile.early_stop``: ``generate(early_stop=EarlyStop(tokenizer))``, off by default; inferred too)."""

    reward: str = "progress"
    horizon: int = 8192
    reflection: list = field(default_factory=list)
    penalty: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.reward not in ("progress", "constant"):
            raise ValueError(f"reco: reward must be 'progress' or 'constant', got {self.reward!r}")
        if self.horizon < self.window or not 0.0 <= self.penalty <= 1.0:
            raise ValueError(f"reco: need horizon >= window and 0 <= penalty <= 1, got horizon={self.horizon}, "
                             f"penalty={self.penalty}")
        if self.penalty > 0 and not self.reflection:
            raise ValueError("reco: a reflection penalty needs the reflection markers as token ids: resolve the "
                             "recipe first with kvcompile.recipes.steps.resolve(recipe, tokenizer)")
        if any(not seq or any(not isinstance(i, int) or i < 0 for i in seq) for seq in self.reflection):
            raise ValueError(f"reco: every reflection marker must be a non-empty sequence of token ids, got "
                             f"{self.reflection!r}")

    @property
    def observation_window(self) -> int:
        return self.horizon if self.reward == "progress" else self.window

    def sources(self) -> tuple[Source, ...]:
        return super().sources() + ((ContextTokens(),) if self.penalty > 0 else ())

    def utility(self, obs: Observation, seg: Tensor, K: int, attn: Tensor) -> Tensor:
        step = per_cost(segment_sums(position_sums(attn, obs), seg, K), obs, seg, K)
        return step * self.step_reward(obs, seg, K)

    def step_reward(self, obs: Observation, seg: Tensor, K: int) -> Tensor:
        """[B, K] the reward of every step, in [0, 1]."""
        B = seg.shape[0]
        reward = torch.ones(B, K, device=seg.device)
        if self.reward == "progress":
            qp = obs.query_positions
            q_seg = seg.gather(1, qp.clamp(0, seg.shape[1] - 1)).masked_fill(qp < 0, -1)  # [B, W]
            later = q_seg[..., None] > torch.arange(K, device=seg.device)  # [B, W, K]: the query comes after
            mass = (query_mass(obs, seg, K) * later).sum(1) / later.sum(1).clamp_min(1)
            built_on = per_cost(mass, obs, seg, K)
            reward = built_on / built_on.amax(1, keepdim=True).clamp_min(torch.finfo(built_on.dtype).tiny)
        if self.penalty > 0:
            ids = position_ids(obs)
            marked, _ = find_anchors(ids, self.reflection)  # True right after a marker
            hit = segment_sums(marked.float(), seg, K) > 0
            reward = torch.where(hit, reward * (1 - self.penalty), reward)
        return reward


@register_scorer("commitkv")
@dataclass
class CommitKV(StepUnits):
    """CommitKV (inferred): each segment after the first starts with a commit (a tool call; split the trace with
    ``segments="tool-calls"``). A segment's deletion effect, read as the attention mass a set of queries pays it
    (mean over query heads and queries: removing keys of mass m rescales the rest by 1/(1 - m)), is measured twice on
    the same trace: before the next commit (by that commit's first ``commit_tokens`` queries) and after it (by the
    last ``window`` queries). A committed segment is retired first when it passes the joint test: its after effect
    is <= ``epsilon`` and no larger than its before effect (the commit consumed it). The first segment (system
    prompt, tool schemas) and the current one are kept first; then segments that fail the test, then the retirable
    ones, each tier by after effect per token."""

    window: int = 32
    commit_tokens: int = 4
    epsilon: float = 0.01
    horizon: int = 8192

    def __post_init__(self):
        super().__post_init__()
        if self.commit_tokens < 1 or self.epsilon < 0 or self.horizon < self.window:
            raise ValueError(f"commitkv: need commit_tokens >= 1, epsilon >= 0 and horizon >= window, got "
                             f"{self.commit_tokens}, {self.epsilon}, {self.horizon}")

    @property
    def observation_window(self) -> int:
        return self.horizon

    def utility(self, obs: Observation, seg: Tensor, K: int, attn: Tensor) -> Tensor:
        before, after = self.effects(obs, seg, K)
        committed = commits_observed(obs, seg, K, self.commit_tokens)  # [B, K]: the next segment's commit was read
        retire = committed & (after <= self.epsilon) & (after <= before)
        first = torch.zeros_like(retire)
        first[:, 0] = True
        density = per_cost(after, obs, seg, K)
        density = density / density.amax(1, keepdim=True).clamp_min(torch.finfo(density.dtype).tiny)
        return torch.where(first, 2.0, torch.where(retire, 0.0, 1.0)) + 0.5 * density

    def effects(self, obs: Observation, seg: Tensor, K: int) -> tuple[Tensor, Tensor]:
        """[B, K] each segment's effect before its next commit, and after (0 where not measured)."""
        q_seg, in_commit = commit_queries(obs, seg, K, self.commit_tokens)
        recent = newest(obs, self.window)[None, :] & (obs.query_positions >= 0)  # [B, W]
        mass = query_mass(obs, seg, K, (in_commit | recent).any(0))  # [B, W, K]
        target = (q_seg - 1).clamp_min(0)  # the queries of segment g + 1's commit measure segment g
        on_prev = mass.gather(2, target[..., None]).squeeze(-1) * in_commit
        B = seg.shape[0]
        before = torch.zeros(B, K, device=seg.device).scatter_add_(1, target, on_prev)
        n_before = torch.zeros(B, K, device=seg.device).scatter_add_(1, target, in_commit.float())
        after = (mass * recent[..., None]).sum(1) / recent.sum(1, keepdim=True).clamp_min(1)
        return before / n_before.clamp_min(1), after


def segment_table(obs: Observation) -> tuple[Tensor, int]:
    """[B, P] the segment of every position (P covers every held and observed position) and K, the segment
    count; one segment when the caller gave none."""
    P = max(int(obs.positions.max()), int(obs.query_positions.max())) + 1
    if obs.segments is None:
        return torch.zeros(obs.positions.shape[0], P, dtype=torch.long, device=obs.positions.device), 1
    seg = obs.segments[:, :P]
    if seg.shape[1] < P:  # positions read after the segments were counted join the last
        seg = torch.cat([seg, seg[:, -1:].expand(-1, P - seg.shape[1])], 1)
    return seg, int(seg.max()) + 1


def newest(obs: Observation, n: int) -> Tensor:
    """[W] bool: the window slots of the ``n`` newest observed queries (of any row)."""
    qp = obs.query_positions
    return ((qp > qp.amax(-1, keepdim=True) - n) & (qp >= 0)).any(0)


def segments_of_queries(obs: Observation, seg: Tensor, K: int, slots: Tensor) -> Tensor:
    """[B, K] True for the segments that hold one of the observed queries in window ``slots`` [W]."""
    qp = obs.query_positions[:, slots]
    q_seg = seg.gather(1, qp.clamp(0, seg.shape[1] - 1))
    hits = torch.zeros(seg.shape[0], K, device=seg.device).scatter_add_(1, q_seg, (qp >= 0).float())
    return hits > 0


def segment_sums(table: Tensor, seg: Tensor, K: int) -> Tensor:
    """[B, K] the sum of a per-position ``table`` [B, P'] (P' <= P) over every segment."""
    P = table.shape[1]
    return torch.zeros(seg.shape[0], K, device=table.device).scatter_add_(1, seg[:, :P], table.float())


def per_cost(values: Tensor, obs: Observation, seg: Tensor, K: int) -> Tensor:
    """``values`` [B, K] per token some head holds in each segment (0 for a segment none holds)."""
    held = (position_sums(obs.valid.float(), obs) > 0).float()
    cost = segment_sums(held, seg, K)
    return torch.where(cost > 0, values / cost.clamp_min(1), 0.0)


def segment_starts(seg: Tensor, K: int) -> Tensor:
    """[B, K] the first position of every segment (P where a segment has none)."""
    P = seg.shape[1]
    index = torch.arange(P, device=seg.device).expand_as(seg)
    return torch.full((seg.shape[0], K), P, device=seg.device).scatter_reduce_(1, seg, index, "amin")


def commit_queries(obs: Observation, seg: Tensor, K: int, commit_tokens: int) -> tuple[Tensor, Tensor]:
    """[B, W] the segment of every observed query (-1 where none), and whether it is one of its segment's first
    ``commit_tokens`` (a commit's query; never in segment 0, which no commit starts)."""
    qp = obs.query_positions
    q_seg = seg.gather(1, qp.clamp(0, seg.shape[1] - 1)).masked_fill(qp < 0, -1)
    starts = segment_starts(seg, K).gather(1, q_seg.clamp_min(0))
    return q_seg, (q_seg > 0) & (qp - starts < commit_tokens)


def commits_observed(obs: Observation, seg: Tensor, K: int, commit_tokens: int) -> Tensor:
    """[B, K] True for segment g when a query of segment g + 1's commit was observed: g was committed."""
    q_seg, in_commit = commit_queries(obs, seg, K, commit_tokens)
    hits = torch.zeros(seg.shape[0], K, device=seg.device).scatter_add_(1, (q_seg - 1).clamp_min(0), in_commit.float())
    return hits > 0


def query_mass(obs: Observation, seg: Tensor, K: int, slots: Tensor | None = None) -> Tensor:
    """[B, W, K] the attention mass each observed query pays each segment (mean over query heads), 256 queries at a
    time; only the window ``slots`` [W] (bool) when given, 0 for the others."""
    B, Hkv = obs.keys.shape[:2]
    G = obs.queries.shape[1] // Hkv
    entry_seg = at_positions(seg, obs)
    mass = torch.zeros(B, obs.query_positions.shape[1], K, device=seg.device)
    blocks = obs.query_blocks(256) if slots is None else slots.nonzero().squeeze(1).split(256)
    for queries in blocks:
        attn = obs.window_attention(queries)  # [B, Hq, w, S]
        per_head = attn.reshape(B, Hkv, G, *attn.shape[2:]).mean(2)  # [B, Hkv, w, S]
        index = entry_seg[:, :, None, :].expand_as(per_head)
        sums = torch.zeros(*per_head.shape[:3], K, device=seg.device).scatter_add_(-1, index, per_head)
        mass[:, queries] = sums.mean(1)
    return mass
