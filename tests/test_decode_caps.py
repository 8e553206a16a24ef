"""A decode-time fraction cap over a batch with a short row: the batch is served, the short row's cap is floored at
what the decode schedule needs (``cache_stats()["decode_uncapped_rows"]`` names it), and every other row holds its
budget."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, tiny_model

import kvcompile


@pytest.mark.parametrize("family, recipe, budget, rows, P", [
    ("llama", "cam", 0.462, [37, 16], 8),
    ("qwen2", "inertiakv", 0.311, [76, 14], 16),
])
def test_a_short_row_runs_at_the_schedules_floor_and_the_batch_is_served(family, recipe, budget, rows, P):
    cm = kvcompile.apply(tiny_model(family), budget=budget, recipe=recipe, page_size=P)
    ids, mask = left_padded_batch(rows, total=max(rows))
    out = cm.generate(ids, mask, max_new_tokens=4, eos_token_id=[])
    assert out.shape == (2, max(rows) + 4)
    stats = cm.cache_stats()
    assert stats["decode_uncapped_rows"] == [1], "the short row, and only it, runs above its cap"
    sched = stats["decode_schedule"]
    floor = -(-(sched["sinks"] + sched["recent"] + sched["every"] + 1) // P) * P
    held = cm.cache.held()  # [L, B, Hkv]
    assert int(held[:, 1].max()) <= floor
    assert int(cm.cache.bytes_held()[0]) <= int(cm.budget_bytes()[0]), "the long row holds its own budget"


def test_a_token_cap_too_small_for_the_schedule_is_still_refused_at_apply():
    """A token cap is the same for every row and known at ``apply``: a schedule it cannot hold is a mistake."""
    with pytest.raises(ValueError, match="leaves no room"):
        kvcompile.apply(tiny_model("llama"), budget=4, recipe="cam", page_size=4)


def test_rows_whose_cap_grows_past_the_floor_are_capped_again():
    cm = kvcompile.apply(tiny_model("llama"), budget=0.462, recipe="cam", page_size=8)
    ids, mask = left_padded_batch([37, 16], total=37)
    cm.generate(ids, mask, max_new_tokens=40, eos_token_id=[])
    assert cm.cache_stats()["decode_uncapped_rows"] == []
    assert (cm.cache.bytes_held() <= cm.budget_bytes()).all()
    assert torch.isfinite(cm.decode(ids[:, -1:])).all()
