"""The DMS threshold wrapper (docs/methods_learned.md#dms) with a mock scorer: outside the newest 128 tokens exactly the
tokens scored below tau are evicted, the kept sets are nested in tau, the window is never evicted, decisions never
revert, the budget caps what is kept, and budget 1.0 reproduces the model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import assert_plain_at_full_budget, fast_first, left_padded_batch

import kvcompile
from kvcompile.methods.base import Scorer, register_scorer

WINDOW = 128


def mock_score(position, layer: int, head):
    """A fixed score per (position, layer, KV head), spread around 0."""
    return torch.sin(position * 0.37 + head * 1.3 + layer * 0.5) * 3


@register_scorer("test-mock-scores")
@dataclass
class MockScores(Scorer):
    def score(self, obs):
        heads = torch.arange(obs.keys.shape[1])[None, :, None]
        return mock_score(obs.positions.float(), obs.layer, heads)


def _dms(tau: float) -> kvcompile.Recipe:
    return kvcompile.Recipe(f"dms-mock{tau}", "dms", "threshold", {"base": "test-mock-scores", "window": WINDOW},
                            {"tau": tau})


def _held(cm) -> list:
    """{(layer, row, head): set of held positions}."""
    pos = cm.held_positions()
    L, B, H, _ = pos.shape
    return {(l, b, h): {int(p) for p in pos[l, b, h] if p >= 0} for l in range(L) for b in range(B) for h in range(H)}


def _prefilled(llama_cm, tau, budget=0.9, lengths=(300, 260)):
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=_dms(tau), page_size=4)
    ids, mask = left_padded_batch(list(lengths), total=max(lengths))
    cm.prefill(ids, mask)
    return cm


@pytest.mark.parametrize("tau", [-1.0, 0.0, 1.5])
def test_exactly_the_tokens_below_tau_outside_the_window_are_evicted(llama_cm, tau):
    lengths = (300, 260)
    cm = _prefilled(llama_cm, tau, lengths=lengths)
    for (layer, row, head), held in _held(cm).items():
        n = lengths[row]
        expected = {p for p in range(n) if p >= n - WINDOW or mock_score(torch.tensor(float(p)), layer, head) >= tau}
        assert held == expected, (layer, row, head)
        assert set(range(n - WINDOW, n)) <= held  # the last 128 are never evicted
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]


def test_kept_sets_are_nested_in_tau(llama_cm):
    kept = [_held(_prefilled(llama_cm, tau)) for tau in (-2.0, 0.0, 1.0, 2.5)]
    for looser, stricter in zip(kept, kept[1:]):
        assert all(stricter[k] <= looser[k] for k in looser)
    assert any(kept[-1][k] < kept[0][k] for k in kept[0])  # tau matters


def test_decisions_are_final_when_more_is_read(llama_cm):
    """Under a budget the second read pushes the cache over, so it compresses again."""
    cm = _prefilled(llama_cm, 0.0, budget=0.6)
    before = _held(cm)
    more, _ = left_padded_batch([40, 40], total=40, seed=5)
    cm.prefill(more)
    after = _held(cm)
    old = {0: set(range(300)), 1: set(range(260))}
    assert all(after[k] & old[k[1]] <= before[k] for k in before)  # nothing evicted comes back
    assert any(after[k] & old[k[1]] < before[k] for k in before)  # the second compression evicted old ones


def test_the_budget_caps_what_the_threshold_keeps(llama_cm):
    """tau below every score keeps everything by the threshold; the budget still holds, the window kept first."""
    cm = _prefilled(llama_cm, -10.0, budget=0.6)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    for (_, row, _), held in _held(cm).items():
        n = (300, 260)[row]
        assert set(range(n - WINDOW, n)) <= held


@pytest.mark.parametrize("every", fast_first([1, 8]))
def test_while_decoding_the_tokens_that_leave_the_window_are_kept_iff_scored_at_least_tau(llama_cm, every):
    """The decode policy "dms": after every run the cache holds exactly the newest 128 positions and the older
    ones scored at least tau, whatever the run interval; tokens decided kept at prefill stay unless their score
    says otherwise (they cannot: a score is fixed once written); rows of different lengths decided apart."""
    tau, lengths, steps = 0.0, (300, 260), 41
    args = {"base": "test-mock-scores", "window": WINDOW}
    recipe = kvcompile.Recipe(f"dms-decode-mock{every}", "dms", "threshold", args, {"tau": tau},
                              decode={"policy": "dms", "every": every, "recent": WINDOW, "args": {**args, "tau": tau}})
    cm = kvcompile.apply(llama_cm, budget=0.9, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch(list(lengths), total=max(lengths))
    cm.generate(ids, mask, max_new_tokens=steps, eos_token_id=[])
    runs = 1 + (steps - 2) // every  # the decode steps after the first token, one run at the first and every `every`
    decided = [n + 1 + (runs - 1) * every for n in lengths]  # tokens read when the last run went
    for (layer, row, head), held in _held(cm).items():
        n, seen = decided[row], lengths[row] + steps - 1
        expected = {p for p in range(n) if p >= n - WINDOW or mock_score(torch.tensor(float(p)), layer, head) >= tau}
        assert held == expected | set(range(n, seen)), (every, layer, row, head)
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]


def test_bad_window_is_refused(llama_cm):
    with pytest.raises(ValueError, match="window"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe(
            "bad", "dms", "threshold", {"base": "test-mock-scores", "window": -1}))


def test_budget_one_reproduces_the_model(llama, llama_cm):
    assert_plain_at_full_budget(llama, llama_cm, _dms(0.0))
