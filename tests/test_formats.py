"""Page formats: codecs within their stated bounds, attention over format pages against the dense oracle, and a
format recipe through the public API (bytes, budgets, errors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_head_attends, fast_first, fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels import reference
from kvcompile.kernels.formats import FORMATS, ChannelCodec, codec_of, encode_pool
from kvcompile.kernels.packing import pack, unpack
from kvcompile.recipes import Recipe, in_format

CODECS = {f"{name}.{part}": getattr(f, part) for name, f in FORMATS.items() for part in ("key", "value")
          if not getattr(getattr(f, part), "page_local", False) and not f.decoded}  # test_spectra, test_anchorkv


def outlier_rows(shape, g: torch.Generator) -> torch.Tensor:
    """Random rows with what real keys have: an outlier channel and a sink token far larger than the rest."""
    x = torch.randn(*shape, generator=g) * 2
    x[..., 3] *= 40  # an outlier channel
    x[..., 0, :] *= 30  # a sink token
    return x


@pytest.mark.parametrize("name", CODECS)
def test_codec_round_trips_within_its_bound_and_re_encodes_to_itself(name):
    codec, g = CODECS[name], torch.Generator().manual_seed(fresh_seed())
    for D in (16, 64):
        x = outlier_rows((3, 5, D), g)
        codes, meta = codec.encode(x)
        y = codec.decode(codes, meta, torch.float32)
        assert y.shape == x.shape
        bound = codec.error_bound(x)
        assert bool(((x - y).abs() <= bound).all()), f"{name}: error {(x - y).abs().max()} above its bound"
        again, meta2 = codec.encode(y)
        if codec.exact_reencode:
            assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)), "re-encoding is exact"
        else:  # rows move between pages as bytes, so nothing re-encodes them; a re-encoding still stays in bound
            assert bool(((codec.decode(again, meta2, torch.float32) - y).abs() <= codec.error_bound(y)).all())
        assert type(codec_of(codes, meta, D)) is type(codec) and torch.equal(
            codec_of(codes, meta, D).decode(codes, meta, torch.float32), y), "the stored tensors name their codec"
        assert codes[0, 0].nbytes + meta[0, 0].nbytes == codec.row_bytes(D), "row_bytes is what a row stores"


@pytest.mark.parametrize("name", CODECS)
def test_codec_products_read_from_codes_equal_products_with_the_decoded_rows(name):
    """``dot`` and ``mix`` (what decode attention asks of a codec; integer and fp8 codecs fold their scales into the
    product instead of decoding) equal the same products with the decoded rows, over several heads."""
    codec, g = CODECS[name], torch.Generator().manual_seed(fresh_seed())
    for D in (16, 64):
        codes, meta = codec.encode(outlier_rows((2, 3, 21, D), g))
        rows = codec.decode(codes, meta, torch.float32)
        q, p = torch.randn(2, 3, 4, D, generator=g), torch.rand(2, 3, 4, 21, generator=g)
        pairs = ((codec.dot(q, codes, meta), q @ rows.transpose(-1, -2)), (codec.mix(p, codes, meta), p @ rows))
        for got, want in pairs:
            # fp32 sums in another order: error relative to the largest product (outliers reach |x| ~ 2000)
            torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_codec_round_trips_each_page_within_its_bound(bits):
    """KIVI's keys: one grid per channel and page, over the page's valid rows only (an outlier channel gets its
    own grid; a sink row still widens its page's)."""
    codec, g = ChannelCodec(bits), torch.Generator().manual_seed(fresh_seed())
    x = outlier_rows((6, 16, 32), g)
    valid = torch.rand(6, 16, generator=g) < 0.8
    valid[0] = True
    x[~valid] = 1e4  # rows without tokens must not widen the grid
    codes, meta = codec.encode_pages(x, valid)
    assert meta.shape == (6, 1, 64) and codes[~valid].eq(0).all()
    y = codec.decode(codes, meta, torch.float32)
    bound = codec.error_bound(x, valid)
    assert bool(((x - y).abs() <= bound)[valid].all())
    assert type(codec_of(codes, meta, 32)) is ChannelCodec
    assert (codes[0].nbytes + meta[0].nbytes) == 16 * codec.row_bytes(32) + codec.page_meta_bytes(32)
    again, _ = codec.encode_pages(y, valid)
    assert torch.equal(again, codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pack_unpack_is_bit_exact(bits):
    g = torch.Generator().manual_seed(fresh_seed())
    q = torch.randint(0, 2**bits, (7, 64), generator=g).to(torch.uint8)
    packed = pack(q, bits)
    assert packed.shape[-1] == 64 * bits // 8 and torch.equal(unpack(packed, bits), q)


def format_pool(codec_name: str, lengths, P: int, D: int, g: torch.Generator, start: int = 0):
    """A one-layer format pool of one row whose heads hold ``lengths`` random entries on shuffled pages (positions
    ``start``...), and the entries it decodes to: (pages, keys, values, positions) per head."""
    fmt = FORMATS[codec_name]
    Hkv, width = len(lengths), max(2, -(-max(lengths) // P))
    ids = torch.randperm(Hkv * width, generator=g).reshape(1, Hkv, width) + 1
    N = Hkv * width + 1
    k_rows, v_rows = outlier_rows((N, P, D), g), torch.randn(N, P, D, generator=g)
    k, km = encode_pool(fmt.key, k_rows)
    v, vm = encode_pool(fmt.value, v_rows)
    k[0], km[0], v[0], vm[0] = (t[0].new_zeros(t[0].shape) for t in (k, km, v, vm))
    pos = (start + torch.arange(width * P)).int()
    page_pos = torch.zeros(N, P, dtype=torch.int32)
    for h in range(Hkv):
        page_pos[ids[0, h]] = pos.view(width, P)
    stored = reference.FormatPages(k, km, v, vm, page_pos, ids.int(), torch.tensor([lengths], dtype=torch.int32))
    keys, values, positions, valid = stored.dense(D, torch.float32)
    return stored, [(keys[0, h, :n], values[0, h, :n], positions[0, h, :n]) for h, n in enumerate(lengths)]


def dtype_pool(lengths, P: int, D: int, g: torch.Generator, start: int):
    """A one-layer model-dtype pool (packed pages) with ``lengths`` entries per head at positions ``start``..."""
    Hkv, width = len(lengths), max(2, -(-max(lengths) // P))
    table = (torch.arange(Hkv * width) + 1).reshape(1, Hkv, width).int()
    k_pages, v_pages = torch.zeros(Hkv * width + 1, P, D), torch.zeros(Hkv * width + 1, P, D)
    page_pos = torch.zeros(Hkv * width + 1, P, dtype=torch.int32)
    k, v = torch.randn(1, Hkv, width * P, D, generator=g), torch.randn(1, Hkv, width * P, D, generator=g)
    slots = reference.rows_of(table, torch.arange(width * P).expand(1, Hkv, -1), P)
    reference.write_tokens(k_pages, v_pages, page_pos, k, v, start + torch.arange(width * P)[None], slots)
    lens = torch.tensor([lengths], dtype=torch.int32)
    heads = [(k[0, h, :n], v[0, h, :n], start + torch.arange(n)) for h, n in enumerate(lengths)]
    return (k_pages, v_pages, page_pos, table, lens), heads


@pytest.mark.parametrize("name", ["int4", "int2", "fp8", "k8v4", "bf16", "kivi2", "tq3"])
@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("T, window", [(1, 0), (1, 5), (4, 0), (4, 7)])
def test_attention_over_format_and_dtype_pages_equals_dense_attention_over_both(name, P, T, window):
    """Heads of lengths 1, P and P + 1 in the format pool (and ragged ones in the model-dtype pool), GQA: the merged
    attention (one partial softmax per pool and tile, merged by log-sum-exp) equals one softmax over the decoded
    entries of both pools."""
    check_attention_over_both(lambda *a: format_pool(name, *a), P, T, window)


def check_attention_over_both(build, P: int, T: int, window: int) -> None:
    """``build(lengths, P, D, g)``'s format pool with heads of lengths 1, P and P + 1 (and ragged heads in the
    model-dtype pool), GQA, T new queries: attention equals one softmax over both pools' decoded entries."""
    g, D, Hq = torch.Generator().manual_seed(fresh_seed()), 16, 6
    stored_lengths = [1, P, P + 1]
    stored, stored_heads = build(stored_lengths, P, D, g)
    start = max(stored_lengths)
    pool, dtype_heads = dtype_pool([3, 0, 2 + T], P, D, g, start)
    q = torch.randn(D, T, Hq, 1, generator=g).permute(3, 2, 1, 0)  # strided, as a decode step's queries arrive
    q_pos = (start + 2 + torch.arange(T))[None]
    out = reference.paged_attention(q, q_pos, *pool, 0.3, window, stored=stored, block_bytes=64)
    G = Hq // len(stored_lengths)
    for h in range(len(stored_lengths)):
        keys, values, pos = (torch.cat([a, b.to(a.dtype)]) for a, b in zip(stored_heads[h], dtype_heads[h]))
        assert_head_attends(out, q, q_pos, h, G, keys, values, pos, window, tol=1e-4)


@pytest.mark.parametrize("name", ["int4", "kivi2", "tq3"])
def test_tiles_merge_to_one_softmax(name):
    """Many tiles of the format pool (tile_tokens below one page) answer what one tile answers, in the merged
    attention (partial softmax states) and in the two-pass decode (scores of every tile, one softmax)."""
    g, D, P = torch.Generator().manual_seed(fresh_seed()), 16, 4
    stored, _ = format_pool(name, [9, 30], P, D, g)
    pool, _ = dtype_pool([2, 5], P, D, g, 40)
    q, q_pos = torch.randn(1, 4, 1, D, generator=g), torch.tensor([[50]])
    dense = reference.gather_dense(*pool)
    one = reference.merged_attention(q, q_pos, dense, stored, 0.4, 0, 1 << 26, tile_tokens=10**6)
    many = reference.merged_attention(q, q_pos, dense, stored, 0.4, 0, 1 << 26, tile_tokens=1)
    # tiles change the float32 summation order, and the outlier channels make logits of |s| up to ~4000, whose fp32
    # rounding (a few ulps of s) reaches the softmax weights: the tolerance scales with both (seed 326 of a fixed
    # generator: 4.0e-4 at |s| 3574, |out| 1.96)
    logits = 0.4 * (q.view(1, 2, 2, D) @ stored.dense(D, torch.float32)[0].transpose(-1, -2)).abs().max()
    atol = 1e-4 + 2**-21 * float(logits) * float(one.abs().max())
    torch.testing.assert_close(one, many, atol=atol, rtol=1e-4)
    for tile in (1, P, 10**6):
        torch.testing.assert_close(reference.stored_decode(q, dense, stored, 0.4, tile_tokens=tile), one,
                                   atol=atol, rtol=1e-4)


# --------------------------------------------------------------------------- through the public API
def _prompt():
    return left_padded_batch([60, 47], total=60, seed=3)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_only_is_close_to_the_full_model_and_reports_its_bytes(llama_cm, name):
    ids, mask = _prompt()
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    ref = full.prefill(ids, mask)
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe=f"full+{name}", page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    pool = stats["formats"][name]
    assert pool["tokens"] == stats["tokens_held"] == int(mask.sum()) * 3 * 2, "every token stored in the format"
    assert stats["formats"]["float32"]["tokens"] == 0
    assert stats["bytes_held"] == pool["codes"] + pool["meta"] + pool["tables"], "held: codes, scales (and tables)"
    assert stats["bytes_held"] < stats["bytes_full"]
    tensors = sum(t.nbytes for t, _ in cm.cache.tensors().values())
    assert stats["bytes_allocated"] == tensors
    # the next token's logits, read over the format pages, stay near the full model's
    nxt = ref[:, -1:].argmax(-1)
    tol = {"int2": 2.0, "int3": 1.0, "tq3": 1.0, "int4": 0.5, "spectra2": 2.0, "spectra3": 1.0, "spectra4": 0.5,
           "saki4": 0.5, "anchor2": 1.0}.get(name, 0.1)
    got, want = cm.decode(nxt), full.decode(nxt)
    assert (got - want).abs().max() < tol, f"{name}: {(got - want).abs().max()}"


@pytest.mark.parametrize("recipe", ["snapkv+int4", "knorm+fp8", "snapkv+int2", "adakv+snapkv+int8",
                                    "block+keydiff+int4", "tova+k8v4", "snapkv+kivi2"])
@pytest.mark.parametrize("budget", [0.25, 0.1, 24])
def test_held_bytes_stay_within_the_budget_scales_included(llama_cm, recipe, budget):
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
    out = cm.generate(ids, mask, max_new_tokens=1)
    stats = cm.cache_stats()
    assert out.shape == (2, 61)
    fmt = cm.recipe.format
    assert stats["formats"][fmt]["tokens"] > 0
    assert stats["formats"][fmt]["codes"] + stats["formats"][fmt]["meta"] <= stats["budget_bytes"]


def test_more_tokens_fit_the_same_bytes_at_lower_precision(llama_cm):
    ids, mask = _prompt()
    held = {}
    for recipe in ("snapkv", "snapkv+int8", "snapkv+int4", "snapkv+int2"):
        cm = kvcompile.apply(llama_cm, budget=0.15, recipe=recipe, page_size=4)
        cm.prefill(ids, mask)
        held[recipe] = cm.cache_stats()["tokens_held"]
    assert held["snapkv"] < held["snapkv+int8"] < held["snapkv+int4"] <= held["snapkv+int2"], held


def test_chunked_prefill_moves_stored_entries_as_bytes(llama_cm):
    """Every chunk's compression re-reads what the last one stored: entries already in the format move as bytes,
    so the first chunk's entries end as one compression of that chunk alone stored them (later chunks differ: they
    attended over int4 pages)."""
    ids = _prompt()[0][:1]
    first = kvcompile.apply(llama_cm, budget=1.0, recipe="full+int4", page_size=4)
    chunked = kvcompile.apply(llama_cm, budget=1.0, recipe="full+int4", page_size=4, prefill_chunk=16)
    first.prefill(ids[:, :16])
    chunked.prefill(ids)
    assert chunked.cache_stats()["formats"]["int4"]["tokens"] == 60 * 3 * 2
    for layer in range(3):
        a, b = first.cache.dense(layer), chunked.cache.dense(layer)
        for x, y in zip(a, b):
            assert torch.equal(x[:, :, :16], y[:, :, :16])


def test_kivi_keeps_its_residual_window_in_the_model_dtype(llama_cm):
    """The newest ``precise_recent`` positions of every row stay in model-dtype pages, the rest is stored in the
    format, and the bytes of both stay within the budget."""
    ids, mask = _prompt()
    recipe = Recipe("kivi-16", None, format="kivi2", precise_recent=16)
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=recipe, page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["formats"]["float32"]["tokens"] == 16 * 2 * 3 * 2
    assert stats["formats"]["kivi2"]["tokens"] == (int(mask.sum()) - 32) * 3 * 2
    assert stats["bytes_held"] <= stats["budget_bytes"]
    keys, _, positions, valid = cm.cache.dense(0)
    seen = mask.sum(1)
    recent = positions.masked_fill(~valid, -1).topk(16, -1).values
    assert bool((recent >= (seen - 16)[:, None, None]).all())
    with pytest.raises(ValueError, match="precise_recent keeps recent tokens out of a page format; it needs a format"):
        Recipe("x", "snapkv", precise_recent=16)
    for name in ("kivi2", "kivi4"):
        assert kvcompile.recipes()[name].format == name


def test_a_recent_window_beside_a_scorer_costs_the_model_dtype_and_the_scored_rest_shares_the_budget(llama_cm):
    """KIVI's hierarchy with eviction: the newest ``precise_recent`` tokens stay in the model's dtype, paid for at
    its cost out of the byte budget, and SnapKV's tokens fill what is left at the format's cost."""
    ids, mask = _prompt()
    recipe = Recipe("snapkv-int8-r4", "snapkv", scorer_args={"window": 8, "kernel": 3}, format="int8",
                    precise_recent=4)
    cm = kvcompile.apply(llama_cm, budget=0.2, recipe=recipe, page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["formats"]["float32"]["tokens"] == 4 * 2 * 3 * 2  # every head of every row: its 4 newest
    assert 0 < stats["formats"]["int8"]["tokens"] < (int(mask.sum()) - 8) * 3 * 2  # scored, and some evicted
    _, _, positions, valid = cm.cache.dense(0)
    newest = positions.masked_fill(~valid, -1).topk(4, -1).values
    assert bool((newest >= (mask.sum(1) - 4)[:, None, None]).all())
    plain = kvcompile.apply(llama_cm, budget=0.2, recipe=dataclasses.replace(recipe, name="r0", precise_recent=0),
                            page_size=4)
    plain.prefill(ids, mask)
    assert plain.cache_stats()["tokens_held"] > stats["tokens_held"]  # the window costs tokens: 4 fp32 > 4 int8
    wide = kvcompile.apply(llama_cm, budget=0.2, recipe=dataclasses.replace(recipe, precise_recent=32), page_size=4)
    with pytest.raises(ValueError, match=r"newest 32 tokens in the model's dtype \(precise_recent\) alone exceed"):
        wide.prefill(ids, mask)
    summary = Recipe("certkv-int8", "snapkv", "certkv", format="int8")  # its weighted summary: model dtype only
    with pytest.raises(NotImplementedError, match="a summarising allocator .* does not work with int8 pages"):
        kvcompile.apply(llama_cm, budget=0.2, recipe=summary, page_size=4)



@pytest.mark.parametrize("name", ["kivi2", "minima-kv"])
def test_a_window_the_budget_cannot_hold_is_refused_before_anything_is_written(llama_cm, name):
    """A prefill (or generate) whose precise window and anchor pages alone would exceed the budget is refused before
    it writes: an empty cache stays empty, a held turn stays as it was, and the model is not left torn. At every
    budget the refusal agrees with the one ``compress()`` gives over the same tokens read uncompressed."""
    ids, mask = _prompt()
    recipe = dataclasses.replace(kvcompile.recipes()[name], name=f"{name}-w16", precise_recent=16)
    outcomes = set()
    for budget in (0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.8):
        cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
        try:
            cm.prefill(ids, mask)
            fits = True
        except ValueError as error:
            assert "alone exceed" in str(error) or "pages does not fit the budget" in str(error)
            assert cm.seen is None  # nothing read, nothing allocated
            fits = False
        other = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
        other.prefill(ids, mask, compress=False)
        before = other.held_positions().clone()
        try:
            other.compress()
            assert fits, f"budget {budget}: prefill refused what compress() holds"
        except ValueError:
            assert not fits, f"budget {budget}: prefill held what compress() refuses"
            assert torch.equal(other.held_positions(), before)
        outcomes.add(fits)
    assert outcomes == {True, False}  # the budgets cross the boundary
    cm = kvcompile.apply(llama_cm, budget=0.6, recipe=recipe, page_size=4)
    cm.prefill(ids, mask)  # 47 and 60 tokens hold the window in 0.6 of their bytes; 20 do not
    held, stats = cm.held_positions().clone(), cm.cache_stats()
    with pytest.raises(ValueError, match="alone exceed|does not fit"):
        cm.generate(ids[:, -20:], max_new_tokens=2)
    assert torch.equal(cm.held_positions(), held) and cm.cache_stats() == stats
    assert cm.decode(ids[:, -1:]).shape[:2] == (2, 1)  # not torn: the held turn goes on

@pytest.mark.parametrize("name", ["kivi2", "int4"])
def test_decoding_demotes_what_leaves_the_window_and_teacher_forcing_sees_the_same_cache(llama_cm, name):
    """While generating, the tokens that leave the ``precise_recent`` window move to the format (KIVI quantizes
    each full group as it decodes): every head holds at most 2 x the window in the model dtype, however long the
    generation, and nothing is evicted. ``decode_many`` over the generated tokens crosses the same demotions as
    one ``decode`` per token, so it returns the same logits and leaves the same cache."""
    R, new = 8, 40
    recipe = Recipe(f"{name}-r{R}", None, format=name, precise_recent=R)
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=recipe, page_size=4)
    ids, mask = _prompt()
    out = cm.generate(ids, mask, max_new_tokens=new, eos_token_id=[])
    stats = cm.cache_stats()
    seen = mask.sum(1) + new - 1  # the last token is returned, never read
    assert stats["tokens_held"] == int(seen.sum()) * 3 * 2, "demotion evicted something"
    in_dtype = torch.tensor(stats["lengths"]) - cm.cache.fmt_lengths
    assert int(in_dtype.max()) <= 2 * R and int(in_dtype.min()) >= R
    assert stats["formats"][name]["tokens"] == int(seen.sum()) * 3 * 2 - int(in_dtype.sum())

    cm.reset()
    cm.prefill(ids, mask)
    stepped = torch.cat([cm.decode(out[:, 60 + t : 61 + t]) for t in range(new - 1)], 1)
    held = lambda: (lambda k, v, p, ok: (k[ok], v[ok], p[ok]))(*cm.cache.dense(1))  # noqa: E731
    dense = held()
    cm.reset()
    cm.prefill(ids, mask)
    forced = cm.decode_many(out[:, 60 : 60 + new - 1])
    torch.testing.assert_close(forced, stepped, rtol=1e-4, atol=1e-4)
    for x, y in zip(held(), dense):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_moving_the_cache_to_another_dtype_keeps_its_format_pages(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full+fp8", page_size=4)
    ids, mask = _prompt()
    cm.prefill(ids, mask)
    before = [t.clone() for t in cm.cache.dense(0)]
    cm.cache.to(torch.float64)
    assert cm.cache.k_pages.dtype == torch.float64 and cm.cache.fmt_k.dtype == torch.float8_e4m3fn
    after = cm.cache.dense(0)
    assert torch.equal(after[0].float(), before[0]) and torch.equal(after[2], before[2])


def test_format_errors_name_the_problem(llama_cm):
    with pytest.raises(ValueError, match="unknown page format"):
        Recipe("x", "snapkv", format="int5")
    with pytest.raises(ValueError, match="above budget"):
        kvcompile.apply(llama_cm, budget=0.05, recipe="full+int4")
    with pytest.raises(NotImplementedError, match="decode-time schedule"):
        kvcompile.apply(llama_cm, budget=0.25, recipe="decoding+knorm+int4")
    with pytest.raises(ValueError, match="already stores"):
        in_format("snapkv+int4", "int8")
    base = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv+int4", page_size=4)
    ids, mask = _prompt()
    base.prefill(ids, mask)
    before = base.cache_stats()
    with pytest.raises(ValueError, match="holds int4 pages"):
        base.fork("snapkv+int8")
    assert base.cache_stats() == before, "a refused fork leaves the cache as it was"


def test_fork_from_a_shared_prefill_stores_each_cells_format(llama_cm):
    ids, mask = _prompt()
    shared = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv", page_size=4)
    shared.prefill(ids, mask, compress=False)
    cells = {r: shared.fork(r) for r in ("snapkv", "snapkv+int4", "snapkv+fp8")}
    for recipe, cell in cells.items():
        cell.compress()
        alone = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
        alone.prefill(ids, mask)
        assert cell.cache_stats()["bytes_held"] == alone.cache_stats()["bytes_held"]
        for x, y in zip(cell.cache.dense(1), alone.cache.dense(1)):
            torch.testing.assert_close(x, y)


@pytest.mark.slow
def test_compiled_programs_read_format_pages_without_recompiling(llama_cm):
    """``compile=True`` generates what the eager model generates over int4 pages, and another prompt length
    recompiles nothing."""
    import torch._dynamo.utils as dynamo_utils

    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv+int4", page_size=4)
    compiled = kvcompile.apply(cm, budget=0.25, recipe="snapkv+int4", page_size=4, compile=True)
    ids, mask = _prompt()
    assert torch.equal(compiled.generate(ids, mask, max_new_tokens=6, eos_token_id=[]),
                       cm.generate(ids, mask, max_new_tokens=6, eos_token_id=[]))
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    other = left_padded_batch([33, 50], total=50, seed=4)
    assert torch.equal(compiled.generate(*other, max_new_tokens=6, eos_token_id=[]),
                       cm.generate(*other, max_new_tokens=6, eos_token_id=[]))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "another prompt length recompiled"


@pytest.mark.parametrize("name", fast_first(["int3", "fp16", "fp8", "k8v4", "kivi2-r8", "think", "tq3", "spectra4"]))
def test_every_format_compiles_to_the_eager_tokens_without_recompiling_per_length(llama_cm, name):
    """Each kind of format through ``torch.compile`` (full graph, Dynamo's ``eager`` backend: the capture and its
    guards, where a format's code dtypes and metadata shapes meet the compiler; the format decode is one opaque op
    after that, and Inductor runs it on int4 above): the eager model's tokens, and a second prompt length
    recompiles nothing. One format per codec layout: a narrow float (bf16 alike), fp8 bytes with row scales,
    packed odd-width integers (int8, int4 and int2 alike), different key and value codecs, KIVI's page-local
    keys demoting while it decodes (``-r8``: the format pool changes size between steps), ThinK's pruned key
    channels (a per-head channel list), TQ3's rotated page-local codes and SPECTRA's rows in a per-head basis (the
    cache's ``fmt_basis``, an input of its own). With eviction (snapkv)
    or demotion, so both pools are read: the format's and the model dtype's (decoded tokens). All of them run in
    one process, as a sweep's forks do: each format compiles its own programs (``Programs.for_format``)."""
    import torch._dynamo.utils as dynamo_utils

    fmt = name.split("-")[0]
    recipe = Recipe(name, None, format=fmt, precise_recent=8) if "-r" in name else f"snapkv+{name}"
    eager = kvcompile.apply(llama_cm, budget=0.25 if "-r" not in name else 0.5, recipe=recipe, page_size=4)
    compiled = kvcompile.apply(eager, budget=eager.budget, recipe=recipe, page_size=4, compile="eager")
    ids, mask = _prompt()
    assert torch.equal(compiled.generate(ids, mask, max_new_tokens=12, eos_token_id=[]),
                       eager.generate(ids, mask, max_new_tokens=12, eos_token_id=[]))
    assert compiled.cache_stats()["formats"][fmt]["tokens"] > 0, "nothing was stored in the format"
    another = kvcompile.apply(eager, budget=0.25, recipe="snapkv+int8" if fmt != "int8" else "snapkv", compile="eager")
    assert another.programs.decode is not compiled.programs.decode, "two formats share compiled code"
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    other = left_padded_batch([33, 50], total=50, seed=4)
    assert torch.equal(compiled.generate(*other, max_new_tokens=12, eos_token_id=[]),
                       eager.generate(*other, max_new_tokens=12, eos_token_id=[]))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "another prompt length recompiled"
