"""Triton decode and compaction kernels against ``kvcompile.kernels.reference``.

Runs on CPU through the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported). With
TRITON_INTERPRET=0 and a CUDA device the same tests run compiled on the GPU. Inputs are fresh random draws each
run; the seed is in every failure message and ``KVC_SEED=<seed>`` replays it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import merged_and_repeated  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install kvcompile[triton])")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvcompile.kernels import reference, triton_decode  # noqa: E402
from kvcompile.kernels.triton_compact import compact  # noqa: E402
from kvcompile.kernels.triton_decode import paged_decode  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
if INTERPRET and not isinstance(triton_decode._decode_split_kernel, InterpretedFunction):
    pytest.fail("kvcompile's Triton kernels were imported before TRITON_INTERPRET=1 was set (by another test "
                "module?): export TRITON_INTERPRET=1 or run this module alone", pytrace=False)

SENTINEL = 1000.0  # pool rows no head may read; large enough to wreck any result that includes them
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


@pytest.fixture
def seed():
    seed = int(os.environ.get("KVC_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    return seed


def special_and_zipf_lengths(n: int, P: int, cap: int) -> torch.Tensor:
    """n head lengths: 0, 1, P, P + 1, then Zipf-skewed ones up to cap, in random order."""
    zipf = [max(1, int(cap / r**1.2)) for r in range(1, n + 1)]
    lengths = torch.tensor(([0, 1, P, P + 1] + zipf)[:n], dtype=torch.int32)
    return lengths[torch.randperm(n)]


def make_cache(lengths: torch.Tensor, P: int, D: int, MAXP: int, dtype, positions=None):
    """Random paged cache for lengths [B, Hkv] with shuffled physical pages.

    Page 0, two spare pages and the rows past each head's length hold SENTINEL (position 0, so only the length
    hides them). positions(b, h, L) gives a head's token positions; default 0 .. L - 1.
    """
    B, Hkv = lengths.shape
    n_pages = (lengths.long() + P - 1) // P
    N = 1 + int(n_pages.sum()) + 2
    k_pages = torch.full((N, P, D), SENTINEL, dtype=dtype)
    v_pages = torch.full((N, P, D), SENTINEL, dtype=dtype)
    page_pos = torch.zeros(N, P, dtype=torch.int32)
    page_table = torch.zeros(B, Hkv, MAXP, dtype=torch.int32)
    free = (torch.randperm(N - 1) + 1).tolist()
    for b in range(B):
        for h in range(Hkv):
            L = int(lengths[b, h])
            pages = torch.tensor([free.pop() for _ in range(int(n_pages[b, h]))], dtype=torch.int64)
            page_table[b, h, : len(pages)] = pages.int()
            pos = torch.arange(L) if positions is None else positions(b, h, L)
            j = torch.arange(L)
            k_pages[pages[j // P], j % P] = torch.randn(L, D).to(dtype)
            v_pages[pages[j // P], j % P] = torch.randn(L, D).to(dtype)
            page_pos[pages[j // P], j % P] = pos.int()
    to = dict(device=DEVICE)
    return k_pages.to(**to), v_pages.to(**to), page_pos.to(**to), page_table.to(**to)


def check_decode(seed, B, Hkv, G, P, D, lengths, dtype, *, window=0, max_splits=4, q_pos=None, positions=None):
    MAXP = max(1, (int(lengths.max()) + P - 1) // P) + 1
    k_pages, v_pages, page_pos, page_table = make_cache(lengths, P, D, MAXP, dtype, positions)
    lengths = lengths.to(DEVICE)
    q = torch.randn(B, Hkv * G, 1, D, device=DEVICE).to(dtype)
    if q_pos is None:
        q_pos = torch.full((B, 1), max(0, int(lengths.max()) - 1), device=DEVICE)  # longest head sees itself
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    got = paged_decode(q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, scale, window,
                       out=out, max_splits=max_splits)
    assert got.data_ptr() == out.data_ptr()

    f32 = (q.float(), q_pos, k_pages.float(), v_pages.float(), page_pos, page_table, lengths)
    want = reference.paged_attention(*f32, scale, window)
    _, _, k_pos, valid = reference.gather_dense(k_pages, v_pages, page_pos, page_table, lengths)
    qp = q_pos.long().view(B, 1, 1)
    visible = valid & (k_pos <= qp) & ((window <= 0) | (qp - k_pos < window))
    seen = visible.any(-1).repeat_interleave(G, dim=1)  # [B, Hq]: query heads with at least one visible key
    msg = f"seed={seed} dtype={dtype} G={G} P={P} D={D} window={window} lengths={lengths.tolist()}"
    assert (got[~seen] == 0).all(), f"heads with no visible key must give zeros; {msg}"
    tol = TOL[dtype]
    torch.testing.assert_close(got[seen].float(), want[seen], atol=tol, rtol=tol, msg=lambda m: f"{m}\n{msg}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G, P, D", [(1, 4, 32), (2, 8, 16), (4, 4, 16), (8, 8, 32)])
def test_decode_lengths_gqa_dtypes(seed, dtype, G, P, D):
    B, Hkv = 2, 3
    lengths = special_and_zipf_lengths(B * Hkv, P, cap=96).view(B, Hkv)
    check_decode(seed, B, Hkv, G, P, D, lengths, dtype)


@pytest.mark.parametrize("window", [1, 5, 40])
def test_decode_window_scattered_positions(seed, window):
    """Compacted heads hold gappy, unordered positions, some after the query (must stay hidden)."""
    B, Hkv, G, P, D = 2, 2, 2, 4, 16
    lengths = torch.randint(1, 60, (B, Hkv), dtype=torch.int32)
    q_pos = torch.randint(60, 100, (B, 1))

    def positions(b, h, L):
        pos = torch.randperm(110)[:L]
        if h == 0:  # head 0 holds at least one key inside the window; the others may see none
            pos[torch.randint(0, L, ())] = q_pos[b, 0] - torch.randint(0, window, ())
        return pos

    check_decode(seed, B, Hkv, G, P, D, lengths, torch.float32, window=window, q_pos=q_pos.to(DEVICE),
                 positions=positions)


@pytest.mark.parametrize("max_splits", [1, 3, 8])
def test_decode_splits(seed, max_splits):
    """Long heads across several splits and tiles, lengths not multiples of the tile; out allocated by the op."""
    B, Hkv, G, P, D = 1, 2, 4, 8, 16
    lengths = torch.tensor([[int(torch.randint(100, 200, ())), int(torch.randint(1, 40, ()))]], dtype=torch.int32)
    k_pages, v_pages, page_pos, page_table = make_cache(lengths, P, D, 26, torch.float16)
    lengths = lengths.to(DEVICE)
    q = torch.randn(B, Hkv * G, 1, D, device=DEVICE).half()
    q_pos = torch.full((B, 1), 300, device=DEVICE)
    args = (q_pos, k_pages, v_pages, page_pos, page_table, lengths, 0.3)
    got = paged_decode(q, *args, max_splits=max_splits)
    want = reference.paged_attention(q.float(), q_pos, k_pages.float(), v_pages.float(), *args[3:])
    tol = TOL[torch.float16]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol,
                               msg=lambda m: f"{m}\nseed={seed} lengths={lengths.tolist()}")


def test_decode_inside_triton_op(seed):
    """The launcher runs as the body of a torch.library.triton_op (eager)."""

    @torch.library.triton_op("kvc_test::paged_decode", mutates_args=())
    def op(q: torch.Tensor, q_pos: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
           page_pos: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_decode(q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, scale)

    lengths = torch.tensor([[3, 9]], dtype=torch.int32)
    k_pages, v_pages, page_pos, page_table = make_cache(lengths, 4, 16, 3, torch.float32)
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    args = (torch.full((1, 1), 9, device=DEVICE), k_pages, v_pages, page_pos, page_table, lengths.to(DEVICE), 0.25)
    torch.testing.assert_close(torch.ops.kvc_test.paged_decode(q, *args), reference.paged_attention(q, *args),
                               msg=lambda m: f"{m}\nseed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 16])
def test_decode_weighted_entries(seed, window, dtype):
    """An entry of log-weight log n decodes as n tokens with its key (the kernel over merged entries against the
    reference over the repeated ones, both over the same dtype-rounded rows, the reference in fp32), and random
    log-weights give what the reference gives."""
    merged, repeated = merged_and_repeated(B=2, Hkv=2, D=16, P=4, seed=seed, device=DEVICE)
    k, v, pos, lw, table, lengths = merged
    q = torch.randn(2, 4, 1, 16, device=DEVICE).to(dtype)
    q_pos = torch.full((2, 1), 45 if window == 0 else 35, device=DEVICE)
    rounded = lambda *pools: [x.to(dtype).float() for x in pools]  # noqa: E731
    tol, msg = TOL[dtype], lambda m: f"{m}\nseed={seed} window={window} dtype={dtype}"  # noqa: E731
    args = (k.to(dtype), v.to(dtype), pos, table, lengths, 0.3, window)
    got = paged_decode(q, q_pos, *args, log_weights=lw, max_splits=2)
    want = reference.paged_attention(q.float(), q_pos, *rounded(*repeated[:2]), *repeated[2:3], *repeated[4:], 0.3,
                                     window)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=msg)
    lw = torch.randn_like(lw) * 2
    got = paged_decode(q, q_pos, *args, log_weights=lw, max_splits=2)
    want = reference.paged_attention(q.float(), q_pos, *rounded(k, v), pos, table, lengths, 0.3, window, log_weights=lw)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=msg)


def keep_sets(lengths: torch.Tensor, K: int):
    """Per head: keep nothing, everything, the tail (largest shift) or a random subset.

    Entries past keep_count hold the head's last token: a valid index, so a kernel that reads them moves a wrong
    row (an assertion failure) instead of reading out of bounds.
    """
    B, Hkv = lengths.shape
    keep_idx = (lengths.long() - 1).clamp_min(0).int()[..., None].repeat(1, 1, K)
    keep_count = torch.zeros(B, Hkv, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            L = int(lengths[b, h])
            c = min(K, int(torch.randint(0, L + 1, ())))
            kind = int(torch.randint(0, 4, ()))
            if kind == 0:
                idx = torch.arange(0)
            elif kind == 1:
                idx = torch.arange(min(L, K))
            elif kind == 2:
                idx = torch.arange(L - c, L)
            else:
                idx = torch.randperm(L)[:c].sort().values
            keep_idx[b, h, : len(idx)] = idx.int()
            keep_count[b, h] = len(idx)
    return keep_idx, keep_count


def compact_case(seed, dtype, P, D, K):
    B, Hkv = 2, 3
    lengths = special_and_zipf_lengths(B * Hkv, P, cap=70).view(B, Hkv)
    MAXP = (int(lengths.max()) + P - 1) // P + 1
    K = K or MAXP * P
    k_pages, v_pages, page_pos, page_table = make_cache(
        lengths, P, D, MAXP, dtype, positions=lambda b, h, L: 1000 * (b * Hkv + h) + torch.arange(L))
    page_lw = torch.randn(page_pos.shape, device=DEVICE)  # a weighted cache's log-weights move with their rows
    keep_idx, keep_count = keep_sets(lengths, K)
    return lengths, (k_pages, v_pages, page_pos, page_lw, page_table), keep_idx.to(DEVICE), keep_count.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("P, D, K", [(4, 16, 20), (8, 32, 13)])
def test_compact_moves_kept_rows_only(seed, dtype, P, D, K):
    """Kept rows land at the front of their head; every other pool row (past keep_count, other heads' pages,
    page 0, spare pages) is bit-identical to before. K is smaller than most lengths, so sources lie past K."""
    case = compact_case(seed, dtype, P, D, K)
    lengths, (k_pages, v_pages, page_pos, page_lw, page_table), keep_idx, keep_count = case
    before = [t.clone() for t in (k_pages, v_pages, page_pos, page_lw)]
    compact(k_pages, v_pages, page_pos, page_lw, page_table, keep_idx, keep_count)

    want = [t.clone() for t in before]
    B, Hkv, _ = page_table.shape
    for b in range(B):
        for h in range(Hkv):
            c = int(keep_count[b, h])
            src, dst = keep_idx[b, h, :c].long(), torch.arange(c, device=DEVICE)
            table = page_table[b, h].long()
            for old, new in zip(before, want):
                new[table[dst // P], dst % P] = old[table[src // P], src % P]
    msg = f"seed={seed} dtype={dtype} lengths={lengths.tolist()} keep_count={keep_count.tolist()}"
    got_all = (k_pages, v_pages, page_pos, page_lw)
    for name, got, exp in zip(("k_pages", "v_pages", "page_pos", "page_lw"), got_all, want):
        assert torch.equal(got, exp), f"{name} differs; {msg}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [None, 13])
def test_compact_matches_reference(seed, dtype, K):
    """Same pools as reference.compact, keep_idx as wide as a full head (None) or narrower than most heads."""
    lengths, cache, keep_idx, keep_count = compact_case(seed, dtype, P=4, D=16, K=K)
    expected = [t.clone() for t in cache[:4]]
    reference.compact(*expected, cache[4], keep_idx, keep_count)
    compact(*cache, keep_idx, keep_count)
    for got, exp in zip(cache[:4], expected):
        assert torch.equal(got, exp), f"seed={seed} lengths={lengths.tolist()} keep_count={keep_count.tolist()}"


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_decode_never_reads_rows_past_a_head(seed, poison):
    """Non-finite values in the rows no head may read (scratch page, spare pages, rows past each head's length)
    never reach an output: the kernel gives what the reference gives over the same pool with those rows zeroed."""
    B, Hkv, G, P, D = 2, 3, 2, 4, 16
    lengths = special_and_zipf_lengths(B * Hkv, P, cap=24).view(B, Hkv)
    MAXP = max(1, (int(lengths.max()) + P - 1) // P) + 1
    k_pages, v_pages, page_pos, page_table = make_cache(lengths, P, D, MAXP, torch.float32)
    unread = k_pages == SENTINEL
    q = torch.randn(B, Hkv * G, 1, D, device=DEVICE)
    q_pos = torch.full((B, 1), int(lengths.max()), device=DEVICE)
    lengths = lengths.to(DEVICE)
    got = paged_decode(q, q_pos, k_pages.masked_fill(unread, poison), v_pages.masked_fill(unread, poison), page_pos,
                       page_table, lengths, D**-0.5, 0)
    want = reference.paged_attention(q, q_pos, k_pages.masked_fill(unread, 0), v_pages.masked_fill(unread, 0),
                                     page_pos, page_table, lengths, D**-0.5, 0)
    assert torch.isfinite(got).all(), f"seed={seed}: a poisoned unread row reached an output"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("name, P", [("int8", 1), ("int4", 16), ("int3", 16), ("int2", 1), ("fp8", 16),
                                     ("k8v4", 1), ("kivi2", 16), ("think", 1), ("think", 16), ("tq3", 1),
                                     ("tq3", 16)])
def test_decode_reads_format_pages_in_registers(seed, name, P):
    """The format pool's launch decodes its rows in the kernel: it matches the reference over the same pools
    (model-dtype heads of lengths 0, 1, P, P + 1, ...; format heads ragged too), GQA, with a window. ThinK's pages
    each list their own random kept channels; TQ3's rotated codes are read with the query rotated instead."""
    from kvcompile.kernels.formats import FORMATS, encode_pool

    fmt, B, Hkv, G, D = FORMATS[name], 2, 3, 2, 32
    lengths = special_and_zipf_lengths(B * Hkv, P, cap=24).view(B, Hkv)
    MAXP = (int(lengths.max()) + P - 1) // P + 1
    k_pages, v_pages, page_pos, page_table = make_cache(lengths, P, D, MAXP, torch.float32,
                                                        positions=lambda b, h, L: 100 + torch.arange(L))
    stored_lengths = special_and_zipf_lengths(B * Hkv, P, cap=40).view(B, Hkv)
    SMAXP = (int(stored_lengths.max()) + P - 1) // P + 1
    sk, sv, spos, stable = make_cache(stored_lengths, P, D, SMAXP, torch.float32,
                                      positions=lambda b, h, L: torch.arange(L))
    kc, km = encode_pool(fmt.key, sk.cpu())
    if name == "think":
        g = torch.Generator().manual_seed(seed)
        kept = fmt.key.kept(D)
        channels = torch.stack([torch.randperm(D, generator=g)[:kept].sort().values for _ in range(sk.shape[0])])
        kc, km = fmt.key.encode_pages(sk.cpu(), torch.ones(sk.shape[:2], dtype=torch.bool), channels)
    vc, vm = encode_pool(fmt.value, sv.cpu())
    stored = reference.FormatPages(*(t.to(DEVICE) for t in (kc, km, vc, vm)), spos, stable, stored_lengths.to(DEVICE))
    q = torch.randn(B, Hkv * G, 1, D, device=DEVICE)
    q_pos = torch.full((B, 1), 150, device=DEVICE)
    args = (q, q_pos, k_pages, v_pages, page_pos, page_table, lengths.to(DEVICE), D**-0.5, 120)
    got = paged_decode(*args, max_splits=3, stored=stored)
    want = reference.paged_attention(*args, stored=stored)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{m}\nseed={seed} {name} P={P}")
