"""Rotated Gaussian-level pages (``rot2``, ``rot3``, ``rot4``, keys above values: ``rotk3v2``, ``rotk4v2``): the
codec reaches a Gaussian's Lloyd-Max error on Gaussian rows and stays near it with an outlier channel, beats the
uniform codes of the same bits in fewer bytes, and a model serves them by name (budgets held, budget 1.0 close to
the model, compiled as eager). The codec's bound, its products and its stored signature are checked with every
row-local codec in ``tests/test_formats.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels.formats import get_format
from kvcompile.kernels.rotated import GAUSSIAN_MSE


def relative_error(name: str, x: torch.Tensor) -> float:
    """Squared error of the format's keys over ``x``'s energy."""
    codec = get_format(name).key
    y = codec.decode(*codec.encode(x), torch.float32)
    return float((x - y).square().sum() / x.square().sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_rows_reach_the_lloyd_max_error_and_an_outlier_channel_stays_near_it(bits):
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(4000, 128, generator=g)
    assert abs(relative_error(f"rot{bits}", x) - GAUSSIAN_MSE[bits]) < 0.05 * GAUSSIAN_MSE[bits]
    x[:, 3] *= 40  # an outlier channel: the rotation spreads it over every channel
    assert relative_error(f"rot{bits}", x) < 1.5 * GAUSSIAN_MSE[bits]


def test_two_bits_rotated_beat_uniform_two_bits_in_fewer_bytes():
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(4000, 128, generator=g)
    assert relative_error("rot2", x) < 0.8 * relative_error("int2", x)
    assert get_format("rot2").token_bytes(128) < get_format("int2").token_bytes(128)


def test_keys_and_values_at_different_bits_cost_their_own_bytes():
    assert get_format("rotk3v2").token_bytes(64) == (get_format("rot3").token_bytes(64)
                                                      + get_format("rot2").token_bytes(64)) / 2
    assert get_format("rotk4v2").page_bytes(64, 16) == 16 * (64 * 4 // 8 + 2 + 64 * 2 // 8 + 2)


def test_a_model_serves_them_by_name_within_every_rows_budget(llama_cm):
    ids, mask = left_padded_batch([120, 77, 33], total=120)
    for recipe in ("snapkv+rot2", "snapkv+rot3", "snapkv+rotk3v2", "snapkv+rot4"):
        cm = kvcompile.apply(llama_cm, budget=0.1, recipe=recipe, page_size=4)
        cm.prefill(ids, mask)
        assert (cm.cache.bytes_held() <= cm.budget_bytes()).all(), recipe
        assert cm.cache_stats()["formats"], f"{recipe}: nothing stored in the format"
        assert torch.isfinite(cm.decode(ids[:, -1:])).all()


def test_at_full_budget_more_bits_stay_closer_to_the_model(llama_cm):
    ids, mask = left_padded_batch([90, 64], total=90)
    plain = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    plain.prefill(ids, mask)
    ref = torch.log_softmax(plain.decode(ids[:, -1:])[:, -1].float(), -1)
    errors = {}
    for name in ("rot2", "rotk3v2", "rot3", "rot4"):
        cm = kvcompile.apply(llama_cm, budget=1.0, recipe=f"full+{name}", page_size=4)
        cm.prefill(ids, mask)
        got = torch.log_softmax(cm.decode(ids[:, -1:])[:, -1].float(), -1)
        errors[name] = float((got.exp() * (got - ref)).sum(-1).max())  # KL(compressed || plain)
    assert errors["rot4"] < errors["rot3"] < errors["rot2"] < 0.5, errors
    assert errors["rotk3v2"] < errors["rot2"], errors  # the same values, keys one bit finer


@pytest.mark.slow
def test_compiled_generates_what_eager_does(llama_cm):
    ids, mask = left_padded_batch([60, 41], total=60)
    runs = [kvcompile.apply(llama_cm, budget=0.3, recipe="snapkv+rot2", page_size=4, compile=c).generate(
        ids, mask, max_new_tokens=8, eos_token_id=[]) for c in (False, True)]
    assert torch.equal(*runs)
