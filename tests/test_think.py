"""ThinK: key channels dropped per head (``methods.think``), stored without them (``formats.PrunedCodec``), and
attention over those pages equal to attention with the dropped channels zeroed."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_head_attends, fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels import reference
from kvcompile.kernels.formats import FORMATS, FloatCodec, PageFormat, PrunedCodec, codec_of
from kvcompile.methods.base import Observation
from kvcompile.methods.think import ThinK
from kvcompile.recipes import Recipe


def random_channels(n: int, D: int, W: int, g: torch.Generator) -> torch.Tensor:
    """[n, W] ascending channel lists, a random one per row."""
    return torch.stack([torch.randperm(D, generator=g)[:W].sort().values for _ in range(n)])


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5])
def test_pruned_pages_decode_to_the_keys_with_their_dropped_channels_zeroed(ratio):
    g, D, P = torch.Generator().manual_seed(fresh_seed()), 16, 4
    codec = PrunedCodec(ratio)
    W = codec.kept(D)
    assert W == D - int(D * ratio)
    x, valid = torch.randn(5, P, D, generator=g), torch.rand(5, P, generator=g) < 0.8
    channels = random_channels(5, D, W, g)
    codes, meta = codec.encode_pages(x, valid, channels)
    assert codes.shape == (5, P, W) and meta.shape == (5, 1, W) and meta.dtype == torch.int16
    zeroed = torch.zeros_like(x).scatter_(-1, channels[:, None].expand(-1, P, -1), x.gather(-1, channels[:, None]
                                                                                         .expand(-1, P, -1)))
    zeroed[~valid] = 0
    decoded = codec_of(codes, meta, D).decode(codes, meta, torch.float32)
    assert torch.equal(decoded, zeroed)
    assert codes[0].nbytes + meta[0].nbytes == P * codec.row_bytes(D) + codec.page_meta_bytes(D)
    if ratio == 0:  # every channel kept, in order: the stored rows are the keys themselves
        assert type(codec_of(codes, meta, D)) is FloatCodec


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("T, window", [(1, 0), (1, 5), (4, 0)])
def test_attention_over_pruned_pages_equals_dense_attention_with_those_channels_zeroed(P, T, window):
    """Heads of lengths 1, P and P + 1, each with channels of its own, GQA: the decode that gathers the query's
    kept channels (``PrunedCodec.dot``) and the merged attention both equal one softmax over the zeroed keys."""
    g, D, Hq = torch.Generator().manual_seed(fresh_seed()), 16, 6
    fmt, lengths = FORMATS["think"], [1, P, P + 1]
    Hkv, width = len(lengths), max(2, -(-max(lengths) // P))
    W = fmt.key.kept(D)
    table = (torch.randperm(Hkv * width, generator=g) + 1).reshape(1, Hkv, width)
    N = Hkv * width + 1
    heads = random_channels(Hkv, D, W, g)
    page_channels = torch.arange(W).repeat(N, 1)
    for h in range(Hkv):
        page_channels[table[0, h]] = heads[h]
    k_rows, v_rows = torch.randn(N, P, D, generator=g) * 3, torch.randn(N, P, D, generator=g)
    valid = torch.ones(N, P, dtype=torch.bool)
    k, km = fmt.key.encode_pages(k_rows, valid, page_channels)
    v, vm = fmt.value.encode(v_rows)
    pos = torch.zeros(N, P, dtype=torch.int32)
    for h in range(Hkv):
        pos[table[0, h]] = torch.arange(width * P, dtype=torch.int32).view(width, P)
    stored = reference.FormatPages(k, km, v, vm, pos, table.int(), torch.tensor([lengths], dtype=torch.int32))
    empty = (torch.zeros(3, P, D), torch.zeros(3, P, D), torch.zeros(3, P, dtype=torch.int32),
             torch.ones(1, Hkv, 2, dtype=torch.int32), torch.zeros(1, Hkv, dtype=torch.int32))
    q = torch.randn(1, Hq, T, D, generator=g)
    q_pos = (max(lengths) + torch.arange(T))[None]
    out = reference.paged_attention(q, q_pos, *empty, 0.3, window, stored=stored, block_bytes=64)
    G = Hq // Hkv
    for h, n in enumerate(lengths):
        mask = torch.zeros(D, dtype=torch.bool)
        mask[heads[h]] = True
        rows = torch.cat([k_rows[table[0, h, i]] for i in range(width)])[:n]
        keys, values = rows * mask, torch.cat([v_rows[table[0, h, i]] for i in range(width)])[:n]
        assert_head_attends(out, q, q_pos, h, G, keys, values, torch.arange(n), window, tol=1e-5)


def test_think_ranks_channels_by_query_and_key_energy():
    """Channel i scores mean(q_i^2) * mean(k_i^2) over the last ``window`` queries (group-averaged) and the held
    keys: a channel large in the keys but silent in the queries is dropped, one large in both is kept."""
    g = torch.Generator().manual_seed(fresh_seed())
    B, Hkv, G, S, D, Wq = 1, 2, 2, 10, 8, 6
    keys, queries = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv * G, Wq, D, generator=g)
    keys[..., 1] *= 50
    queries[..., 1] = 0  # no query reads channel 1: it scores 0 whatever the keys hold
    keys[..., 5] *= 20
    queries[..., 5] *= 20
    query_positions = torch.arange(Wq)[None]
    obs = Observation(keys, keys, torch.arange(S).expand(B, Hkv, S), torch.ones(B, Hkv, S, dtype=torch.bool),
                      queries, query_positions, 0.3, 0, 0, 1)
    kept = ThinK(0.5, window=4).channels(obs)
    assert kept.shape == (B, Hkv, 4)
    assert bool((kept == 5).any(-1).all()) and not bool((kept == 1).any())
    q2 = queries[:, :, 2:].square().mean(2).view(B, Hkv, G, D).mean(2)  # the last 4 queries
    expect = (q2 * keys.square().mean(2)).topk(4, -1).indices.sort(-1).values
    assert torch.equal(kept, expect)


def _prompt():
    return left_padded_batch([60, 47], total=60, seed=3)


@pytest.mark.parametrize("recipe, budget", [("think", 1.0), ("think", 0.95), ("snapkv+think", 0.4),
                                            ("snapkv+think", 0.15), ("snapkv+think", 24)])
def test_think_holds_its_budget_and_keeps_its_channels_while_decoding(llama_cm, recipe, budget):
    """By name: after the prompt, bytes within the budget, the channel lists counted. While generating (``think``:
    the newest tokens keep every channel and are pruned as they leave the window), every format page of a head lists
    the channels its head keeps."""
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
    cm.generate(ids, mask, max_new_tokens=1)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= (stats["budget_bytes"] or stats["bytes_full"])  # budget 1.0: no budget_bytes
    pool = stats["formats"]["think"]
    assert pool["tokens"] > 0 and pool["meta"] > 0, "the channel lists are bytes held"
    assert pool["codes"] + pool["meta"] == stats["bytes_held"] - stats["formats"]["float32"]["codes"]
    out = cm.generate(ids, mask, max_new_tokens=40, eos_token_id=[])
    assert out.shape == (2, 100)
    cache = cm.cache
    assert cache.fmt_k.shape[-1] == cache.head_dim // 2
    if recipe == "think":
        assert cm.cache_stats()["formats"]["think"]["tokens"] > pool["tokens"], "decoded tokens were pruned"
    for layer in range(cache.num_layers):
        for b in range(2):
            for h in range(cache.num_kv_heads):
                n = int(cache.fmt_lengths[layer, b, h])
                pages = cache.fmt_table[layer, b, h, : -(-n // 4)].long()
                assert bool((cache.fmt_k_meta[pages, 0] == cache.fmt_channels[layer, b, h]).all())


def test_think_through_the_model_equals_zeroed_key_channels(llama_cm):
    """The cache's stored keys are the model's keys with the dropped channels zeroed (budget 1.0: every token
    stored), and the channels are those ThinK picks from the observed queries."""
    ids, mask = _prompt()
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    full.prefill(ids, mask)
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="think", page_size=4)
    cm.prefill(ids, mask)
    for layer in range(cm.cache.num_layers):
        k_full, v_full, pos_full, ok_full = full.cache.dense(layer)
        k, v, pos, ok = cm.cache.dense(layer)
        assert torch.equal(ok, ok_full) and torch.equal(pos[ok], pos_full[ok])
        kept = torch.zeros(*k.shape[:2], k.shape[-1], dtype=torch.bool)
        kept.scatter_(-1, cm.cache.fmt_channels[layer].long(), True)
        recent = pos >= (mask.sum(1) - 32)[:, None, None]  # the window keeps every channel
        want = torch.where(recent[..., None] | kept[:, :, None], k_full, 0.0)
        torch.testing.assert_close(k[ok], want[ok])
        torch.testing.assert_close(v[ok], v_full[ok])


def test_without_dropped_channels_the_format_reproduces_the_model(llama_cm, monkeypatch):
    """rho = 0 (every channel kept) answers what the uncompressed model answers. Its pages cost 1/16 more than the
    model dtype's (each lists its 16 channels), so the budget is 200 tokens per head, not 1.0."""
    monkeypatch.setitem(FORMATS, "think0", PageFormat("think0", PrunedCodec(0.0), FloatCodec(torch.float32)))
    ids, mask = _prompt()
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    cm = kvcompile.apply(llama_cm, recipe=Recipe("think0", None, format="think0"), page_size=4,
                         budget=200)
    torch.testing.assert_close(cm.prefill(ids, mask), full.prefill(ids, mask), atol=1e-4, rtol=1e-4)
    nxt = torch.tensor([[5], [7]])
    torch.testing.assert_close(cm.decode(nxt), full.decode(nxt), atol=1e-4, rtol=1e-4)
    assert cm.cache_stats()["formats"]["think0"]["tokens"] == int(mask.sum()) * 3 * 2


def test_think_refuses_a_budget_it_cannot_meet_without_eviction(llama_cm):
    with pytest.raises(ValueError, match="stores every token in think pages, 0.781 of the model dtype"):
        kvcompile.apply(llama_cm, budget=0.75, recipe="think", page_size=4)
    assert kvcompile.recipes()["think"].format == "think"


def test_a_fork_of_a_shared_prefill_keeps_the_channels_think_alone_keeps(llama_cm):
    """A sweep's cells fork one prefill that observed the widest window any cell reads: ThinK's choice there (from
    the same 32 queries) is the one a model running ``think`` alone makes."""
    ids, mask = _prompt()
    shared = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)  # observes the last 32 queries
    shared.prefill(ids, mask, compress=False)
    cell = shared.fork("think", 0.95)
    cell.compress()
    alone = kvcompile.apply(llama_cm, budget=0.95, recipe="think", page_size=4)
    alone.prefill(ids, mask)
    assert torch.equal(cell.cache.fmt_channels, alone.cache.fmt_channels)
    assert not torch.equal(alone.cache.fmt_channels, torch.arange(8, dtype=torch.int16).expand_as(
        alone.cache.fmt_channels)), "the queries chose the channels, not the default"
    for x, y in zip(cell.cache.dense(1), alone.cache.dense(1)):
        torch.testing.assert_close(x, y)
