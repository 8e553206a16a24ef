"""Validation of what users pass in, done before any state changes: a bad input raises a ``ValueError`` (or
``TypeError``) that names the argument and what it may be, and leaves the model and its cache as they were."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .early_stop import EarlyStop
from .kernels.formats import get_format
from .methods.base import PAGES, TOKENS


def same_adapter(recipe, current) -> None:
    """Refuse ``recipe`` on programs captured for ``current`` (a recipe) when they serve another adapter: the
    programs run the weights the model was applied with (``kvcompile.adapters``)."""
    if recipe.adapter != current.adapter:
        raise ValueError(f"recipe {recipe.name!r} serves the model with another adapter (adapter {recipe.adapter}, "
                         f"not {current.adapter}): apply it to the plain model")


def positive_int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def count(name: str, value) -> None:
    """A number of tokens that may be 0: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def tokens(
    input_ids, attention_mask, *, vocab_size: int | None, rows: int | None, seen: Tensor | None, extra: int = 0,
    max_positions: int | None = None, name: str = "input_ids",
) -> Tensor:
    """The real-token mask [B, T] (bool) of a batch, after checking it: shape, dtype, token ids in
    [0, vocab_size), the mask's shape and values, every row non-empty on an empty cache (``rows`` None), and
    ``seen`` [B] (None: empty) + its tokens + ``extra`` still to come within ``max_positions``."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"{name} must be an integer tensor of shape [batch, tokens]")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"empty prompt: {name} has shape {tuple(input_ids.shape)}")
    if rows is not None and B != rows:
        raise ValueError(f"batch size {B} does not match the {rows} sequences in the cache; call reset()")
    if vocab_size is not None and bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0]
        raise ValueError(f"{name} holds token id {int(bad)}, outside the model's vocabulary [0, {vocab_size})")
    if attention_mask is None:
        real = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    else:
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask shape {shape} does not match {name} {tuple(input_ids.shape)}")
        if not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        real = attention_mask.bool()
    if rows is None and not real.any(1).all():
        raise ValueError("a sequence in the batch has no tokens (its attention_mask row is all zeros)")
    if max_positions is not None:
        before = torch.zeros(B, dtype=torch.long) if seen is None else seen.cpu()
        longest = int((before + real.sum(1).cpu()).max()) + extra
        if longest > max_positions:
            raise ValueError(
                f"sequence too long: {longest} positions (including tokens still to generate), "
                f"the model has {max_positions} (max_position_embeddings)"
            )
    return real


def prompt(input_ids, attention_mask, context_ids, context_mask, max_new_tokens: int, **limits):
    """``generate``'s prompt, checked as one fresh sequence (the context, when given, then the question, then the
    tokens to generate): (context real mask or None, question real mask)."""
    if context_ids is None:
        return None, tokens(input_ids, attention_mask, rows=None, seen=None, extra=max_new_tokens, **limits)
    if not isinstance(context_ids, Tensor) or context_ids.dim() != 2 or not isinstance(input_ids, Tensor) \
            or context_ids.shape[0] != input_ids.shape[0]:
        raise ValueError("context_ids must be [batch, tokens] with the same batch size as input_ids")
    context = tokens(context_ids, context_mask, rows=None, seen=None, name="context_ids", **limits)
    question = tokens(input_ids, attention_mask, rows=input_ids.shape[0], seen=context.sum(1), extra=max_new_tokens,
                      **limits)
    if not question.any(1).all():
        raise ValueError("a row of input_ids (the question) has no tokens: generation starts from its last token")
    return context, question


def generation(max_new_tokens, do_sample, temperature, top_p, eos_token_id, pad_token_id, generator) -> list[int]:
    """Check ``generate``'s options; returns the eos ids as a list."""
    positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if do_sample:
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"sampling needs a finite temperature > 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:  # NaN fails the comparison too
            raise ValueError(f"sampling needs 0 < top_p <= 1, got {top_p!r}")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    for name, ids in (("eos_token_id", eos), ("pad_token_id", [] if pad_token_id is None else [pad_token_id])):
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"{name} must be a token id (an int >= 0) or a list of them, got {ids!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return eos


def early_stop(stop, draft) -> None:
    """``generate``'s ``early_stop``: None or an ``EarlyStop``, and not with a speculative ``draft``."""
    if stop is not None and not isinstance(stop, EarlyStop):
        raise ValueError(f"early_stop must be a kvcompile.early_stop.EarlyStop (or None), got {type(stop).__name__}")
    if stop is not None and draft is not None:
        raise ValueError("early_stop is not supported with a speculative draft: generate with one or the other")


def rewinds(who: str, recipe, schedule) -> None:
    """Refuse taking tokens back (``rewind``; a speculative draft's rejected proposals) from ``who``'s cache when
    its ``recipe`` changes it while decoding (``schedule``: its decode schedule, if any; a precise recent window):
    what would be taken back may already have been compressed."""
    if schedule is not None or recipe.precise_recent:
        raise ValueError(f"{who}'s recipe {recipe.name!r} changes its cache while decoding, so tokens it read "
                         "could not be taken back (rewind, speculative drafts): use a recipe that compresses at "
                         "prefill")


def same_chunking(recipe: str, wanted: int | None, done: int | None) -> None:
    """A fork shares a prefill already done: refuse a recipe that prefills in other chunks (``block+...``)."""
    if wanted != done:
        raise ValueError(f"recipe {recipe!r} prefills {wanted or 'all'} tokens at a time, but this cache was prefilled "
                         f"{done or 'all'} at a time: a shared prefill cannot stand in for it; apply it and prefill "
                         "on its own")


def recipe(recipe, allocator, budget, spec, page_size: int) -> None:
    """Refuse, at ``apply``, a recipe and budget that cannot run together: an allocator that does not fit the
    model's layers, a recipe that evicts nothing under a budget below what it stores, and a page format with what
    it does not support yet."""
    allocator.check(spec.num_layers)
    if recipe.merge and allocator.strategy.weighted:
        raise ValueError(f"recipe {recipe.name!r} merges evicted values beside a summarising allocator, whose "
                         "summary already stands for them; use one or the other")
    if recipe.format is None:
        if recipe.scorer is None and not budget.is_full:
            raise ValueError(f"recipe {recipe.name!r} keeps every token; use budget=1.0 or pick a compressing recipe")
        return
    unsupported = {"a decode-time schedule": recipe.decode, "key re-rotation": recipe.rerotate_keys,
                   "value merging": recipe.merge,
                   "an allocator of whole pages": allocator.strategy == PAGES,
                   "a summarising allocator (its weighted entries live in the model-dtype pool only)":
                       allocator.strategy.weighted}
    for what, used in unsupported.items():
        if used:
            raise NotImplementedError(f"recipe {recipe.name!r}: {what} does not work with {recipe.format} pages yet")
    share = get_format(recipe.format).token_bytes(spec.head_dim, page_size) / (2 * spec.head_dim * spec.dtype.itemsize)
    if recipe.scorer is None and budget.kind == "fraction" and budget.value < share:
        raise ValueError(f"recipe {recipe.name!r} stores every token in {recipe.format} pages, {share:.3f} of the "
                         f"model dtype's bytes, above budget={budget}; add a scorer that evicts "
                         f"('<scorer>+{recipe.format}') or raise the budget")


def dense_pass(recipe, source, prefill_chunk, schedule, allocator, restores: int = 0) -> None:
    """A scorer that reads ``Gradients``, ``HiddenStates`` or ``Restore`` runs the source model densely over the whole
    context at its one compression: refuse a model without a source (a loaded artifact), chunked prefill and
    decode-time schedules, which compress parts of a context. ``restores`` > 0 (``Restore``): the pass runs a
    transformers model on embeddings, and its entries are kept through a per-token plan in the model's dtype."""
    who = f"recipe {recipe.name!r} runs a dense pass of the source model over the context"
    if source is None:
        raise NotImplementedError(f"{who}; a model loaded from an artifact has none: apply the recipe to the model")
    if prefill_chunk or schedule is not None:
        raise ValueError(f"{who} at one compression: not with prefill_chunk or a decode-time schedule")
    if restores and not hasattr(getattr(source, "config", None), "num_hidden_layers"):
        raise NotImplementedError(f"recipe {recipe.name!r} runs its restore pass on a transformers causal LM "
                                  f"(inputs_embeds, past_key_values); got {type(source).__name__}")
    if restores and (allocator.strategy != TOKENS or recipe.format is not None):
        raise NotImplementedError(f"recipe {recipe.name!r} keeps its restore entries through a per-token allocator in "
                                  f"the model's dtype, not {allocator.strategy.name!r} / {recipe.format}")


def keep_last(n, seen: int, recipe, scorer, allocator) -> None:
    """``compress(keep_last=n)``: refuse, naming it, a count that is not an int in [0, tokens read), or a recipe
    whose compression this does not support (a page format, an allocator that is not per token, a reconstruction)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < seen:
        raise ValueError(f"keep_last must be an int in [0, {seen}) (tokens read), got {n!r}")
    reconstructs = scorer is not None and any(s.reconstructs for s in scorer.sources())
    unsupported = {"a page format": recipe.format, "an allocator of pages or summaries": allocator.strategy != TOKENS,
                   "a reconstruction pass": reconstructs}
    for what, used in unsupported.items():
        if n and used:
            raise NotImplementedError(f"recipe {recipe.name!r}: compress(keep_last=...) does not support {what} yet")
