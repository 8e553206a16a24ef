"""Rows and requests are isolated: what one row writes (padding, or non-finite activations) never reaches another
row's output, and nothing of a request is readable after reset()."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, fast_first, tiny_model

import kvcompile

POISON = VOCAB - 2  # a token id whose embedding row is made non-finite


def poisoned_model(value: float, rows: tuple[int, ...] = (0, POISON)):
    """A tiny Llama whose embedding rows ``rows`` (the pad id 0 and POISON) are ``value`` (NaN or inf)."""
    model = tiny_model("llama", seed=5, layers=2)
    with torch.no_grad():
        model.get_input_embeddings().weight[list(rows)] = value
    return model


def clean_and_dirty_batch():
    """Row 0: 12 clean tokens, no padding. Row 1: left padding (pad id 0), then a POISON token among real ones."""
    clean = torch.randint(2, POISON, (12,), generator=torch.Generator().manual_seed(0))
    dirty = torch.tensor([0, 0, 0, 0, 5, 6, POISON, 7, 8, 9, 10, 11])
    mask = torch.tensor([[1] * 12, [0] * 4 + [1] * 8])
    return torch.stack([clean, dirty]), mask


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("compile", fast_first([False, True], ids=["eager", "compiled"]))
def test_one_rows_poison_reaches_no_other_row_nor_a_later_request(value, compile):
    model = poisoned_model(value)
    cm = kvcompile.apply(model, budget=1.0, recipe="full", page_size=4, compile=compile)
    alone = kvcompile.apply(cm, budget=1.0, recipe="full", page_size=4)  # the clean row, by itself
    ids, mask = clean_and_dirty_batch()
    want = alone.generate(ids[:1], max_new_tokens=10, eos_token_id=[])
    got = cm.generate(ids, mask, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(got[:1], want), "the dirty row changed the clean row's tokens"
    cm.reset()
    cm.prefill(ids, mask)
    step = cm.decode(torch.tensor([[3], [POISON]]))
    alone.reset()
    alone.prefill(ids[:1])
    torch.testing.assert_close(step[:1], alone.decode(torch.tensor([[3]])), atol=1e-5, rtol=1e-5)
    later = cm.generate(ids[:1], max_new_tokens=10, eos_token_id=[])
    assert torch.equal(later, want), "a later clean request read what the poisoned one left behind"


def test_compressed_dirty_row_reaches_no_other_row():
    """The same through compression: a poisoned row's scores and evictions stay its own."""
    model = poisoned_model(float("nan"), rows=(0,))
    cm = kvcompile.apply(model, budget=0.5, recipe="snapkv", page_size=4)
    alone = kvcompile.apply(cm, budget=0.5, recipe="snapkv", page_size=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, POISON, (2, 40), generator=g)
    ids[1, :6] = 0  # row 1: six pads (a NaN embedding), then 34 tokens
    mask = (ids != 0).long()
    mask[0] = 1
    got = cm.generate(ids, mask, max_new_tokens=8, eos_token_id=[])
    want = alone.generate(ids[:1], max_new_tokens=8, eos_token_id=[])
    assert torch.equal(got[:1], want)
