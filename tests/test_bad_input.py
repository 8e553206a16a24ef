"""Bad input raises an error that names the problem, and leaves the model and any cache untouched."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import left_padded_batch

import kvcompile
from kvcompile import Budget


@pytest.mark.parametrize(
    "budget, message",
    [
        (0.0, r"must be in \(0, 1\]"),
        (-0.5, r"must be in \(0, 1\]"),
        (1.5, r"must be in \(0, 1\]"),
        (math.nan, "NaN"),
        (0, "positive int"),
        (-3, "positive int"),
        ("lots", "cannot read budget"),
        ("0B", "smaller than one byte"),
        (True, "budget must be"),
        (None, "budget must be"),
    ],
)
def test_bad_budget(llama_cm, budget, message):
    with pytest.raises(ValueError, match=message):
        kvcompile.apply(llama_cm, budget=budget, recipe="snapkv")


def test_budget_forms():
    assert Budget.parse(0.25) == Budget("fraction", 0.25)
    assert Budget.parse(512) == Budget("tokens", 512.0)
    assert Budget.parse("64MiB").value == 64 * 2**20
    assert Budget.parse("1.5 GB").value == 1.5e9
    assert Budget.parse(1.0).is_full and not Budget.parse(0.999).is_full
    assert Budget.parse(0.5).bytes_per_sequence(100, 2, 3, 8) == 0.5 * 100 * 2 * 3 * 8


def test_unknown_recipe_lists_known_ones(llama_cm):
    with pytest.raises(ValueError, match="unknown recipe 'snapkvv'.*snapkv"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="snapkvv")


def test_unknown_option(llama_cm):
    with pytest.raises(TypeError, match="compression_ratio"):
        kvcompile.apply(llama_cm, budget=0.5, compression_ratio=0.5)
    with pytest.raises(ValueError, match="recipe 'bad'.*windw"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("bad", "snapkv", scorer_args={"windw": 8}))
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        kvcompile.Recipe("bad", "nope")
    with pytest.raises(ValueError, match="page_size"):
        kvcompile.apply(llama_cm, budget=0.5, page_size=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        kvcompile.apply(llama_cm, budget=0.5, prefill_chunk=-1)
    with pytest.raises(ValueError, match="keeps every token"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="full")


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        kvcompile.apply("llama", budget=0.5)


@pytest.fixture
def filled(llama_cm):
    """A compressed model holding two sequences, and a snapshot of its cache."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, mask = left_padded_batch([30, 20], total=30)
    cm.prefill(ids, mask)
    snapshot = {name: buf.clone() for name, buf in cm.cache.named_buffers()}
    return cm, snapshot, cm.seen.clone()


def assert_untouched(cm, snapshot, seen):
    assert torch.equal(cm.seen, seen)
    for name, buf in cm.cache.named_buffers():
        assert torch.equal(buf, snapshot[name]), f"cache buffer {name} changed"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda cm: cm.prefill(torch.zeros(2, 0, dtype=torch.long)), "empty prompt"),
        (lambda cm: cm.prefill(torch.ones(3, 4, dtype=torch.long)), "batch size 3 does not match the 2"),
        (lambda cm: cm.prefill(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 5)), "attention_mask shape"),
        (lambda cm: cm.prefill(torch.ones(2, 4, dtype=torch.long), torch.full((2, 4), 2)), "only 0"),
        (lambda cm: cm.prefill(torch.ones(2, 500, dtype=torch.long)), "sequence too long: 530 positions"),
        (lambda cm: cm.prefill(torch.ones(4, dtype=torch.long)), r"\[batch, tokens\]"),
        (lambda cm: cm.prefill(torch.ones(2, 4)), "integer tensor"),
        (lambda cm: cm.decode(torch.ones(2, 2, dtype=torch.long)), "one token per sequence"),
        (lambda cm: cm.decode(torch.ones(1, 1, dtype=torch.long)), "batch size 1 does not match"),
        (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=0), "max_new_tokens"),
        (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=600), "sequence too long"),
        (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), context_ids=torch.ones(3, 4, dtype=torch.long)),
         "same batch size"),
        (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), do_sample=True, temperature=0.0), "temperature"),
    ],
)
def test_bad_tokens_leave_cache_untouched(filled, call, message):
    cm, snapshot, seen = filled
    with pytest.raises(ValueError, match=message):
        call(cm)
    assert_untouched(cm, snapshot, seen)


def test_all_padding_row_is_refused(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv")
    with pytest.raises(ValueError, match="has no tokens"):
        cm.prefill(torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    assert cm.seen is None


def test_decode_before_prefill(llama_cm):
    with pytest.raises(RuntimeError, match="call prefill first"):
        kvcompile.apply(llama_cm, budget=0.5).decode(torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="call prefill"):
        kvcompile.apply(llama_cm, budget=0.5).cache_stats()


@pytest.mark.parametrize("recipe, budget", [("kivi2", "24KiB"), ("minima-kv", "24KiB"), ("anchorkv", "32KiB")])
def test_a_refused_turn_changes_nothing(llama_cm, recipe, budget):
    """A turn whose tokens in the model's dtype (a precise window, anchor pages) or whose anchor tables would not fit
    a byte budget is refused before anything is written: the cache's stats are the same, and the next call
    answers what a model that never saw the refused turn answers."""
    first, _ = left_padded_batch([30], total=30)
    second, _ = left_padded_batch([200], total=200, seed=1)
    cm, twin = (kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4) for _ in range(2))
    for model in (cm, twin):
        model.prefill(first)
    before = cm.cache_stats()
    with pytest.raises(ValueError, match="budget"):
        cm.prefill(second)
    assert cm.cache_stats() == before
    token = first[:, -1:]
    assert torch.equal(cm.decode(token), twin.decode(token))
