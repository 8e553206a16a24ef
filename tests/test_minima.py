"""Minima-KV: TQ3 pages (``kernels.tq3``) within their bound, and the recipe through the public API: anchor pages
and the recent window in the model's dtype, every other token in TQ3, nothing evicted, bytes within the budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels.formats import FORMATS, codec_of
from kvcompile.kernels.hadamard import fwht
from kvcompile.recipes import Recipe


def test_fwht_is_orthonormal_and_its_own_inverse():
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3, 5, 64, generator=g)
    torch.testing.assert_close(fwht(fwht(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        fwht(torch.zeros(2, 48))


@pytest.mark.parametrize("part", ["key", "value"])
@pytest.mark.parametrize("D", [16, 64])
def test_tq3_round_trips_each_page_within_its_bound(part, D):
    """Outlier channel, sink token, rows without tokens (ignored by the grid, stored as zeros): each valid row's
    L2 error within the codec's bound (a sink widens its page's grid for every row: Minima-KV keeps the first page
    as an anchor); the stored tensors name their codec; bytes as stated."""
    codec, g = getattr(FORMATS["tq3"], part), torch.Generator().manual_seed(fresh_seed())
    P = 16
    x = torch.randn(6, P, D, generator=g) * 2
    x[..., 3] *= 40
    x[:, 0] *= 30
    valid = torch.rand(6, P, generator=g) < 0.8
    valid[0] = True
    valid[1] = False  # a page that holds nothing
    x[~valid] = 1e4  # must not widen any grid
    codes, meta = codec.encode_pages(x, valid)
    y = codec_of(codes, meta, D).decode(codes, meta, torch.float32)
    assert type(codec_of(codes, meta, D)) is type(codec)
    err = (x - y).norm(dim=-1)
    bound = codec.error_bound(x, valid)
    assert bool((err <= bound)[valid].all()), f"error {(err - bound)[valid].max()} above the bound"
    plain = torch.randn(4, P, D, generator=g)  # no outlier: 3 bits keep most of each row
    codes, meta = codec.encode_pages(plain, torch.ones(4, P, dtype=torch.bool))
    rel = (codec_of(codes, meta, D).decode(codes, meta, torch.float32) - plain).norm(dim=-1) / plain.norm(dim=-1)
    assert float(rel.mean()) < 0.4, float(rel.mean())
    assert codes[0].nbytes + meta[0].nbytes == P * codec.row_bytes(D) + codec.page_meta_bytes(D)


def _prompt():
    return left_padded_batch([60, 47], total=60, seed=3)


def _recipe(recent: int):
    return dataclasses.replace(kvcompile.recipes()["minima-kv"], name=f"minima-r{recent}", precise_recent=recent)


def _in_dtype(cm) -> list[torch.Tensor]:
    """Per layer, the positions each head holds in the model-dtype pool (-1 past them)."""
    pos = cm.cache.positions()
    j = torch.arange(pos.shape[-1])
    return pos.masked_fill(j < cm.cache.fmt_lengths[..., None], -1)


def test_minima_keeps_anchor_pages_and_the_window_in_the_dtype_and_the_rest_in_tq3(llama_cm):
    """By name: every 4th page of positions (page size 4 here) and the newest 8 tokens in fp32, the rest in TQ3,
    every token held, bytes within the budget; while generating, the tokens that leave the window move to TQ3 but
    the anchor pages stay."""
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=0.6, recipe=_recipe(8), page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    seen = mask.sum(1)
    assert stats["tokens_held"] == int(seen.sum()) * 3 * 2, "nothing is evicted"
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["formats"]["tq3"]["tokens"] > 0 and stats["formats"]["tq3"]["meta"] > 0

    def check(seen, window_max):
        pos = _in_dtype(cm)
        live = pos >= 0
        anchor = (pos // 4) % 4 == 0
        recent = pos >= (seen - window_max)[None, :, None, None]
        assert bool((anchor | recent)[live].all()), "a token in the model dtype is neither an anchor nor recent"
        for b in range(2):  # every anchor position and the newest 8 of each row are in the dtype pool
            p = torch.arange(int(seen[b]))
            want = p[((p // 4) % 4 == 0) | (p >= int(seen[b]) - 8)]
            for layer in range(3):
                for h in range(2):
                    have = pos[layer, b, h][live[layer, b, h]]
                    assert set(want.tolist()) <= set(have.tolist())

    check(seen, 8)
    cm.generate(ids, mask, max_new_tokens=30, eos_token_id=[])
    seen = mask.sum(1) + 29
    assert cm.cache_stats()["tokens_held"] == int(seen.sum()) * 3 * 2
    check(seen, 16)  # up to twice the window waits in the dtype between demotions


def test_minima_runs_by_name_and_refuses_a_budget_its_anchors_do_not_fit(llama_cm):
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=0.8, recipe="minima-kv", page_size=4)
    out = cm.generate(ids, mask, max_new_tokens=2)
    stats = cm.cache_stats()
    assert out.shape[1] >= 61 and stats["formats"]["tq3"]["tokens"] > 0
    low = kvcompile.apply(llama_cm, budget=0.3, recipe=_recipe(8), page_size=4)
    with pytest.raises(ValueError, match=r"\(precise_recent\) and every 4th page \(precise_anchors\) alone exceed"):
        low.prefill(ids, mask)
    with pytest.raises(ValueError, match="precise_anchors keeps anchor pages out of a page format; it needs a format"):
        Recipe("x", "snapkv", precise_anchors=4)
