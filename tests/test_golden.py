"""Refactors keep behaviour: every case of ``tests/golden.py`` replayed against the golden file recorded before
them (kept positions per layer, row and KV head; bytes held; budget; generated tokens; the next step's logits)."""

from __future__ import annotations

import gzip
import json

import pytest
from golden import GOLDEN, NATIVE, ROUNDING, TOLERANCE, cases, run_case

with gzip.open(GOLDEN, "rt") as f:
    RECORDED = json.load(f)["cases"]


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.fixture(autouse=True)
def native(monkeypatch):
    for name, value in NATIVE.items():
        monkeypatch.setenv(name, value)


def test_the_golden_file_covers_every_case():
    """A recipe added since the recording must be recorded (``python tests/golden.py --record ... --only NAME``
    into a copy, merged by hand), not silently left out."""
    assert sorted(RECORDED) == sorted(cases())


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RECORDED))
def test_behaviour_is_unchanged(case, models):
    want, got = RECORDED[case], run_case(case, models)
    assert got.keys() == want.keys(), f"{case}: {got.get('refused', got.keys())} vs {want.get('refused', want.keys())}"
    if "refused" in want:  # refused then and now (the message's wording is not behaviour)
        assert "refused" in got, f"{case}: refused before, now {sorted(got)}"
        return
    if "logits" not in want:
        assert got == want
        return
    for key in ("held", "bytes_held", "bytes_held_rows", "budget_bytes", "tokens"):
        assert got[key] == want[key], f"{case}: {key} changed"
    tol = TOLERANCE.get(case, ROUNDING)
    for row_got, row_want in zip(got["logits"], want["logits"]):
        for a, b in zip(row_got, row_want):
            assert abs(float.fromhex(a) - float.fromhex(b)) <= tol, f"{case}: logits differ ({a} vs {b}, tol {tol})"
