"""The steps of a ``CompressedModel`` (mixed into it): where a prompt's or a decoded token's tokens go
(``PagedKVCache.append``), the queries they leave in the observation ring, the program that reads them
(``Programs.run``), and what keeps the cache in shape between decode steps: a recipe's decode schedule, or a format
recipe's demotion of the tokens that leave its precise recent window (``PagedKVCache.demote``)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import observation
from .compress import check_fits
from .kernels.formats import get_format
from .schedule import DecodeCompressor

RESERVE_AHEAD = 64  # tokens of room a plain decode reserves at a time (allocation stays off the step)


class Steps:
    """Prefill and decode steps; the state they read and write is ``CompressedModel``'s."""

    @contextlib.contextmanager
    def _changing(self):
        """Around every change of state: if the block does not finish, the state is torn until ``reset``."""
        if self._torn:
            raise RuntimeError("the last call stopped half way through a step (interrupted?): call reset(); "
                               "generate() resets by itself")
        self._torn = True
        yield
        self._torn = False

    def _read_prompt(self, input_ids: Tensor, real: Tensor, context_ids: Tensor | None, context_real: Tensor | None,
                     segments: Tensor | None = None):
        """``generate``'s prefill; returns the last logits. The context, when given, is compressed before the question
        is read. A scorer that reads the ``Question`` source instead reads the context unobserved and the question
        observed, then compresses both, the budget counting both: its window holds the question's queries alone."""
        asks = self.reads_question
        if context_ids is not None:
            context_real = context_real.to(self.device)
            self._prefill(context_ids, context_real, not asks, "last", pending=not asks, segments=segments)
            if asks:  # the budget counts the context too
                self.context_tokens = self.context_tokens + context_real.sum(1)
        logits = self._prefill(input_ids, real, context_ids is None or asks, "last", pending=False,
                               segments=segments if context_ids is None else None)
        self.query_aware = context_ids is None or self.recipe.query_aware
        return logits

    @property
    def decode_window(self) -> int:
        """Queries per layer the decode schedule reads while generating (0: none, the ring is released)."""
        schedule = self.decoder.schedule if self.decoder else self.schedule  # a small cap may have fitted it
        return schedule.observation_window if schedule else 0

    @property
    def observation_window(self) -> int:
        """Queries per layer this model reads when it compresses (its scorer's sources) or decodes."""
        scorer = observation.window(self.scorer.sources()) if self.scorer else 0
        stored = get_format(self.recipe.format).window if self.recipe.format else 0  # what its encoding reads
        return max(self.decode_window, scorer, stored)

    def _refuse_without_question(self, compressing: bool = True) -> None:
        """Raise, before anything changes, when a scorer that ranks by the question would compress without it."""
        if compressing and self.reads_question and not self.budget.is_full:
            raise ValueError(f"recipe {self.recipe.name!r} ranks the context by the question's queries: give the "
                             "question apart, generate(question_ids, context_ids=context_ids)")

    def _refuse_compressing(self, read: Tensor, budget_tokens: Tensor | None = None) -> None:
        """Raise, before anything changes, when a compression after reading ``read`` [B] more tokens cannot go as
        asked; its budget is measured against ``budget_tokens`` [B] (default: the context read so far and ``read``)."""
        fresh = self.seen is None
        self._refuse_without_question()
        if not fresh:
            self._refuse_partial_replay()
        if budget_tokens is None:
            budget_tokens = read if fresh else self.context_tokens + read.to(self.context_tokens)
        self._refuse_overflowing_window(read, budget_tokens, fresh)

    def _refuse_unrestorable(self, budget_tokens: Tensor) -> None:
        """Raise, before anything changes, when a budget cannot hold a page for the restore entries of every
        (layer, KV head) (``Restore``: they are kept, and charged, whatever else is evicted)."""
        n = observation.restores(self.scorer.sources()) if self.scorer is not None and not self.budget.is_full else 0
        if not n:
            return
        cache, P = self.cache, self.cache.page_size
        need = cache.num_layers * cache.num_kv_heads * -(-n // P) * cache.page_bytes
        budget = int(cache.budget_bytes(self.budget, budget_tokens.cpu()).min())
        if budget < need:
            raise ValueError(f"recipe {self.recipe.name!r} keeps {n} restore entries in every (layer, KV head): "
                             f"{need} bytes in pages of {P}; the budget holds {budget} bytes for this context: raise "
                             "the budget or read a longer context")

    def _refuse_overflowing_window(self, read: Tensor, budget_tokens: Tensor, fresh: bool) -> None:
        """Raise, before anything changes, when a format recipe's compression could not hold the budget once ``read``
        [B] more tokens are read (``compress.check_fits``), or a restoring recipe's (``_refuse_unrestorable``)."""
        self._refuse_unrestorable(budget_tokens)
        if self.recipe.format is None:  # nothing to check: no budget is worked out for a prefill that cannot fail
            return
        seen = read if fresh else self.seen + read.to(self.seen)
        check_fits(self.cache, self.recipe, self.scorer, self.cache.budget_bytes(self.budget, budget_tokens),
                   seen, fresh)

    def _refuse_partial_replay(self) -> None:
        """Raise, before anything changes, when a scorer's dense pass (``Gradients``, ``HiddenStates``) could not
        replay every token the cache holds: some were compressed before."""
        if self.reads_dense and self.seen is not None and not self.budget.is_full:
            pending = sum((r.sum(1) for _, r in self._pending), torch.zeros_like(self.seen))
            if not torch.equal(pending.to(self.seen), self.seen):
                raise ValueError(f"recipe {self.recipe.name!r} runs a dense pass over every token the cache read, "
                                 "but this cache was compressed before: reset() and read the context in one prefill")

    def _prefill_step(self, ids: Tensor, real: Tensor, name: str, compressing: bool) -> Tensor:
        step = self.cache.append(real, observe=self.observation_window if compressing else self.decode_window, ids=ids)
        return self.programs.run(name, ids.to(self.device), step, self.cache)

    def decode(self, input_ids: Tensor) -> Tensor:
        """Append one token per sequence ([B, 1]) and return its logits [B, 1, V]."""
        if self.seen is None:
            raise RuntimeError("decode needs a prefilled cache: call prefill first")
        if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, got input_ids of shape {tuple(input_ids.shape)}")
        real = self._check(input_ids)
        with self._changing():
            return self._decode(input_ids, real)

    def _decode(self, input_ids: Tensor, real: Tensor | None = None) -> Tensor:
        self._begin_decoding()
        return self._advance("decode", input_ids, real)

    def decode_many(self, input_ids: Tensor) -> Tensor:
        """Append T known tokens per sequence ([B, T]) exactly as T ``decode`` calls would; returns logits [B, T, V].

        For teacher forcing (scoring a known continuation) at a fraction of the cost: the prefill program reads the
        tokens a segment at a time, each segment ending where the decode schedule runs, so every token sees the
        cache that T ``decode`` calls would have shown it (up to floating-point summation order).
        """
        if self.seen is None:
            raise RuntimeError("decode_many needs a prefilled cache: call prefill first")
        real, outs, start, T = self._check(input_ids), [], 0, input_ids.shape[1]
        with self._changing():
            self._begin_decoding()
            while start < T:
                n = min(T - start, self._until_maintenance() or T)
                outs.append(self._advance("prefill", input_ids[:, start : start + n], real[:, start : start + n]))
                start += n
        return torch.cat(outs, 1)

    def _until_maintenance(self) -> int | None:
        """Decode steps from now up to and including the one after which the cache is next compressed or demoted
        (None: never)."""
        if self.decoder is not None:
            return self.decoder.until_run()
        window = self.recipe.precise_recent
        return max(window - self.cache.appended, 1) if window else None

    def _begin_decoding(self) -> None:
        if self.decoder is None and self.schedule is not None:  # decoding starts: the cap holds from here on
            decoder = DecodeCompressor(self.schedule, self.budget, self.programs.layers)
            decoder.start(self.cache)
            self.decoder = decoder

    def _advance(self, name: str, input_ids: Tensor, real: Tensor | None) -> Tensor:
        """Append ``input_ids`` [B, n] as n decode steps (no schedule run falls inside them), then run it if due."""
        if real is None:
            real = torch.ones(input_ids.shape, dtype=torch.bool, device=self.device)
        ahead = 1 if self.decoder is not None else RESERVE_AHEAD  # a schedule reserves its own room
        observe = self.observation_window if self._observing else self.decode_window
        step = self.cache.append(real, observe=observe, reserve_ahead=ahead, ids=input_ids)
        logits = self.programs.run(name, input_ids.to(self.device), step, self.cache)
        if self.decoder is not None:
            self.decoder.step(self.cache, input_ids.shape[1])
        elif self.recipe.precise_recent and self.cache.appended >= self.recipe.precise_recent:
            # the tokens that left the window go to the format: at most 2 x precise_recent stay in the model dtype
            self.cache.demote(self.recipe.precise_recent, shrink=False, anchors=self.recipe.precise_anchors)
        return logits
