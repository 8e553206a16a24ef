"""DapQ (https://arxiv.org/abs/2603.11564): score the context with pseudo queries that stand where the answer will."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation, QueryWindow, Reconstruction, register_scorer
from .snapkv import SnapKV


@register_scorer("dapq")
@dataclass
class DapQ(SnapKV):
    """SnapKV whose observation window is a pseudo-query window at the positions the generation will take: after the
    context is prefilled, ``window`` pseudo tokens are prefilled at the next positions, their queries alone in the
    window; a token's score is SnapKV's (the window's mean attention, pooled over the GQA group, smoothed over
    ``kernel`` neighbours); the pseudo tokens themselves are dropped (never kept). A window at the prompt's own end
    reads where the prompt's last words look; queries at the answer's positions read where decoding will, and the
    paper finds their position matters more than their content. Query-agnostic: the question is read after.

    Inferred (from the abstract): the pseudo tokens' content is the context's last ``window`` tokens again (the paper
    builds position-aware pseudo queries whose exact content we could not read); SnapKV's aggregation over them."""

    def sources(self):
        return QueryWindow(self.window), Reconstruction()

    def reconstruction_prompt(self, input_ids, real):
        return input_ids[:, -self.window:], real[:, -self.window:].bool()

    def score(self, obs: Observation):
        pseudo = obs.positions >= obs.first_query()[:, None, None]
        return super().score(obs).masked_fill(pseudo, float("-inf"))
