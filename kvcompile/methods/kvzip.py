"""KVzip (https://arxiv.org/abs/2505.23416): keep what the model reads when asked to repeat the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (
    Allocator,
    Observation,
    QueryWindow,
    Reconstruction,
    Scorer,
    pooled_rank,
    protect,
    register_allocator,
    register_scorer,
)


@register_scorer("kvzip")
@dataclass
class KVzip(Scorer):
    """Query-agnostic context-reconstruction score. After the context is prefilled, the runtime prefills
    ``instruction_ids`` + the context again (``reconstruction_prompt``); a token's score is the largest attention
    any of those reconstruction queries pays it, max over the GQA group (as in the paper and kvpress). The
    reconstruction's own tokens are never kept (the runtime drops them), the first ``n_sink`` tokens always are.
    Pair with the ``global-topk`` allocator (the paper's cross-layer, cross-head eviction). Costs one more
    prefill of the context. ``window`` must hold the whole reconstruction prompt (its first query marks where
    the reconstruction's tokens begin).

    Inferred: (1) the paper's prompt is the tokenized "Repeat the previous context exactly." plus the chat
    template's reply prefix; scorers have no tokenizer, so the instruction is ``instruction_ids`` (default: none,
    the context alone). (2) The paper reconstructs in 2048-token chunks; here the whole prefilled prompt is one
    chunk (with ``prefill_chunk``, every token read since the last compression is reconstructed when a chunk is
    compressed, and its queries also score the tokens kept from earlier chunks)."""

    instruction_ids: tuple[int, ...] = ()
    n_sink: int = 4
    window: int = 8192
    block: int = 256

    def __post_init__(self):
        if self.window < 1 or self.block < 1 or self.n_sink < 0:
            raise ValueError(f"need window, block >= 1 and n_sink >= 0; got {self.window}, {self.block}, {self.n_sink}")
        if any(not isinstance(t, int) or t < 0 for t in self.instruction_ids):
            raise ValueError(f"instruction_ids must be token ids (ints >= 0), got {self.instruction_ids!r}")
        self.instruction_ids = tuple(self.instruction_ids)

    @property
    def observation_window(self) -> int:
        return self.window

    def sources(self):
        return QueryWindow(self.window), Reconstruction()

    def reconstruction_prompt(self, input_ids, real):
        B = input_ids.shape[0]
        instruction = torch.tensor(self.instruction_ids, dtype=input_ids.dtype, device=input_ids.device)
        instruction = instruction.expand(B, -1)
        ones = torch.ones(instruction.shape, dtype=torch.bool, device=real.device)
        return torch.cat([instruction, input_ids], 1), torch.cat([ones, real.bool()], 1)

    def probe_weights(self, obs: Observation):
        """[B, W] a factor (>= 0) on each reconstruction query's attention before the max over probes (None:
        none)."""
        return None

    def key_weights(self, obs: Observation):
        """[B, Hq, S] a per-key factor on the best probe's attention (None: none)."""
        return None

    def score_per_query_head(self, obs: Observation):
        best = self.probe_max(obs, self.probe_weights(obs)).flatten(1, 2)
        weights = self.key_weights(obs)
        best = best if weights is None else best * weights
        return self.context_frame(obs, best)

    def probe_max(self, obs: Observation, rows=None):
        """[B, Hkv, G, S] the largest attention any observed query pays each held entry, each query's attention
        times its factor in ``rows`` [B, W] (None: 1): from the recorded log-sum-exps where every query has one
        (``_probe_max_by_lse``), else from each block's softmax over the keys it sees."""
        best = self._probe_max_by_lse(obs, rows)
        if best is not None:
            return best
        B, Hkv, S, _ = obs.keys.shape
        best = torch.zeros(B, Hkv, obs.queries.shape[1] // Hkv, S, device=obs.keys.device)
        buffer = obs.block_buffer(self.block)
        for queries in obs.query_blocks(self.block):
            attn, keys = obs.attention_span(queries, buffer=buffer)
            if rows is not None:
                attn.mul_(rows[:, None, None, queries, None])
            torch.maximum(best[..., keys], attn.amax(3), out=best[..., keys])
        return best

    def _probe_max_by_lse(self, obs: Observation, rows):
        """The probe maximum [B, Hkv, G, S] over the context's entries from the log-sum-exp the reconstruction's
        attention recorded for every query (``Observation.query_lse``): max_i c_i exp(s_ij - lse_i) is
        exp(max_i (s_ij - lse_i + log c_i)), one product over the context's keys and no softmax. Every context entry
        stands before every reconstruction query, so none is masked; the reconstruction's own entries are not
        computed (they are never kept). None where some observed query has no recorded log-sum-exp."""
        lse, real = obs.query_lse, obs.query_positions >= 0  # [B, Hq, W], [B, W]
        if lse is None or not bool(torch.isfinite(lse).all(1)[real].all()):
            return None
        B, Hkv, S, D = obs.keys.shape
        G = obs.queries.shape[1] // Hkv
        context = ((obs.positions < obs.first_query()[:, None, None]) & obs.valid).sum(-1)  # appended after them
        end = int(context.max())
        shift = lse if rows is None else lse - rows.log()[:, None]
        shift = shift.masked_fill(~real[:, None], float("inf"))  # a slot without a query pays nothing
        best = torch.full((B, Hkv, G, S), float("-inf"), device=obs.keys.device)
        keys = obs.keys[:, :, :end].float().transpose(-1, -2)
        buffer = obs.block_buffer(self.block)
        for queries in obs.query_blocks(self.block):
            q = obs.queries[:, :, queries]
            w = q.shape[2]
            logits = buffer[: B * Hkv * G * w * end].view(B, Hkv, G * w, end)
            torch.matmul(q.reshape(B, Hkv, G * w, D).float() * obs.scale, keys, out=logits)
            logits.sub_(shift[:, :, queries].reshape(B, Hkv, G * w, 1))
            torch.maximum(best[..., :end], logits.view(B, Hkv, G, w, end).amax(3), out=best[..., :end])
        return best.exp_()

    def context_frame(self, obs: Observation, scores):
        """``scores`` [B, H, S] (H = Hkv or Hq) with the reconstruction's own tokens at -inf (never kept) and the
        first ``n_sink`` tokens pinned."""
        G = scores.shape[1] // obs.keys.shape[1]
        first = obs.first_query()  # [B]
        appended = (obs.positions >= first[:, None, None]).repeat_interleave(G, 1)
        scores = scores.masked_fill(appended, float("-inf"))
        return protect(scores, (obs.positions < self.n_sink).repeat_interleave(G, 1))

    def score(self, obs: Observation):
        scores = self.score_per_query_head(obs)
        B, Hq, S = scores.shape
        return scores.reshape(B, obs.keys.shape[1], -1, S).amax(2)


@register_allocator("global-topk")
@dataclass
class GlobalTopK(Allocator):
    """One competition per sequence over every (layer, KV head, token): the top ``budget`` scores are kept, so
    layers and heads hold different numbers of tokens (KVzip's default, ``layerwise=False`` in kvpress).

    ``whole_pages``: the competition is between pages instead, since a byte budget pays for whole pages. Each head's
    tokens, best first, fill its pages in turn; a page is worth the sum of its tokens' scores (for scores that add
    up, such as attention); the ``max_pages`` pages worth most are kept. A head's pages are worth less and less,
    so this keeps the most score any whole-page choice can. Without it, the engine rounds the token-level counts
    down to pages by their partial pages' sizes alone: at 0.1 of SmolLM2's cache, where many heads keep a handful of
    tokens, that emptied such heads and doubled KVzip's KL against kvpress's token-level masks (docs/kvpress.md)."""

    whole_pages: bool = False

    def allocate_pages(self, scores, lengths, max_pages, page_size):
        if not self.whole_pages:
            return None
        L, B, Hkv, S = scores.shape
        n = -(-S // page_size)
        best = scores.sort(-1, descending=True).values.clamp_min(0).nan_to_num(0.0)  # -inf: nothing held
        best = torch.nn.functional.pad(best, (0, n * page_size - S)).unflatten(-1, (n, page_size))
        worth = best.double().sum(-1)  # [L, B, Hkv, n] (pinned scores add up to inf: those pages go first)
        held = -(-lengths.long() // page_size)
        worth = worth.masked_fill(torch.arange(n, device=scores.device) >= held[..., None], float("-inf"))
        pooled = worth.permute(1, 0, 2, 3).reshape(B, L * Hkv, n)
        chosen = (pooled_rank(pooled) < max_pages[:, None]) & (pooled.flatten(-2) > float("-inf"))
        pages = chosen.reshape(B, L, Hkv, n).sum(-1).permute(1, 0, 2)
        return (pages * page_size).minimum(lengths.long())

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, S = scores.shape
        pooled = scores.permute(1, 0, 2, 3).reshape(B, L * Hkv, S)
        rank = pooled_rank(pooled)
        chosen = (rank < budget[:, None]) & (pooled.flatten(-2) > float("-inf"))
        return chosen.reshape(B, L, Hkv, S).sum(-1).permute(1, 0, 2).minimum(lengths.long())
