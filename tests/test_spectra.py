"""Latent page formats: SPECTRA (the basis against the paper's own construction, the bit allocation
against brute force) and SAKI's keys (the code channels' score energies), rows within their stated bound,
attention over latent pages against the dense oracle, and the formats through the public API (calibrated by
``apply``, bytes within the budget, forked)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_head_attends, fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels import latent, reference
from kvcompile.methods import saki, spectra
from kvcompile.methods.moments import Moments
from kvcompile.methods.rope import rotate


def correlated_rows(n: int, D: int, g: torch.Generator, heads: int = 2) -> torch.Tensor:
    """[heads, n, D] rows with correlated channels of very different energies, an outlier channel and a sink."""
    mix = torch.randn(heads, D, D, generator=g) * torch.logspace(0, -2, D)
    x = torch.randn(heads, n, D, generator=g) @ mix.transpose(-1, -2)
    x[..., 3] += 8.0
    x[:, 0] *= 25
    return x


def test_basis_is_section_12s_factorisation_of_the_projection():
    """SPECTRA factors k = h W through G = E[hᵀh]: M = G^½ W = U Σ Vᵀ, latent c = h G^-½ U Σ^½. The basis here is
    built from E[kᵀk] alone: its energies are Σ, and its latent of k is SPECTRA's c (up to each channel's sign)."""
    g = torch.Generator().manual_seed(fresh_seed())
    hidden, D, n = 24, 8, 500
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64) @ torch.randn(hidden, hidden, generator=g,
                                                                                dtype=torch.float64)
    W = torch.randn(hidden, D, generator=g, dtype=torch.float64)
    k = h @ W
    G = h.T @ h / n
    values, vectors = torch.linalg.eigh(G)
    root, inv_root = (vectors * values.sqrt()) @ vectors.T, (vectors * values.rsqrt()) @ vectors.T
    U, S, _ = torch.linalg.svd(root @ W, full_matrices=False)
    c_paper = h @ inv_root @ U * S.sqrt()
    basis = spectra.basis((k.T @ k / n)[None], 4, 8)
    torch.testing.assert_close(basis.energy[0].double(), S, rtol=1e-4, atol=1e-6)
    c = k.float() @ basis.down[0]
    sign = torch.sign((c * c_paper.float()).sum(0))
    torch.testing.assert_close(c * sign, c_paper.float(), rtol=1e-3, atol=1e-3 * float(c_paper.abs().max()))
    moment = c.T @ c / n
    torch.testing.assert_close(moment, torch.diag(basis.energy[0]), atol=1e-3 * float(S.max()), rtol=0)
    assert bool((basis.energy[0][:-1] >= basis.energy[0][1:]).all()), "latent channels sorted by energy"
    torch.testing.assert_close(basis.down[0] @ basis.up[0], torch.eye(D), atol=1e-4, rtol=0)


def test_allocation_is_the_integer_optimum_of_the_water_filling_objective():
    g = torch.Generator().manual_seed(fresh_seed())
    for _ in range(20):
        energy = torch.rand(12, generator=g).pow(4).sort(descending=True).values * 100
        steps = int(torch.randint(1, 14, (), generator=g))
        widths = spectra.allocate(energy, steps, 4)
        per_group = energy.double().view(3, 4).sum(-1)
        cost = lambda w: float((per_group * 0.25 ** torch.tensor(w, dtype=torch.float64)).sum())  # noqa: E731
        best = min((w for w in itertools.product(range(9), repeat=3) if sum(w) == steps), key=cost)
        assert int(widths.sum()) == steps and max(widths.tolist()) <= spectra.MAX_BITS
        assert cost(widths.tolist()) <= cost(best) + 1e-9, (widths.tolist(), best)


def test_saki_keys_read_back_exactly_at_full_rank_and_code_errors_cost_their_score_energy():
    """SAKI's basis at full rank (what ``saki4`` stores, before quantizing): μ + B_q B_kᵀ (k - μ) = k, and an error δ
    in code channel i moves a query's score by a mean square of λ_i δ² over the calibration queries (up Σq upᵀ =
    diag λ): what the widths are allocated by."""
    g = torch.Generator().manual_seed(fresh_seed())
    D, n = 16, 400
    keys, queries = correlated_rows(n, D, g), correlated_rows(n, D, g)
    mean = keys.mean(1)
    sigma_k, sigma_q = keys.transpose(-1, -2) @ keys / n, queries.transpose(-1, -2) @ queries / n
    moments = [Moments(sigma_k.double(), sigma_k.double(), sigma_q.double(), mean.double())]
    codecs = (latent.LatentCodec(4, 8, rotary=True, basis="saki"), latent.LatentCodec(4, 8, basis="identity"))
    basis = latent.model_basis(codecs, moments, (), D)[0]
    k_basis = basis[0]
    back = latent.to_latent(keys, k_basis) @ k_basis[:, :D] + k_basis[:, 2 * D, None]
    torch.testing.assert_close(back, keys, atol=1e-3 * float(keys.abs().max()), rtol=1e-3)
    for h in range(2):
        energies = saki.score_energies(sigma_q[h].double(), (sigma_k[h] - torch.outer(mean[h], mean[h])).double())
        up = k_basis[h, :D].double()
        torch.testing.assert_close(up @ sigma_q[h].double() @ up.T, torch.diag(energies),
                                   atol=1e-3 * float(energies.max()), rtol=0)
        widths = latent.widths_of(k_basis, 8)[h]
        assert torch.equal(widths, spectra.allocate(energies.square(), 4 * D // 8, 8)), "bits by score error"
    v_basis = basis[1]  # values: the rows themselves, every group at the codec's bits
    torch.testing.assert_close(v_basis[:, :D], torch.eye(D).expand(2, D, D))
    assert bool((latent.widths_of(v_basis, 8) == 4).all())


@pytest.mark.parametrize("bits, group", [(4, 16), (3, 16), (2, 32), (8, 32)])
def test_rows_round_trip_within_their_bound_keys_rotated_back_to_their_positions(bits, group):
    g = torch.Generator().manual_seed(fresh_seed())
    D, n = 64, 40
    x = correlated_rows(n, D, g)
    parts = spectra.basis(x.transpose(-1, -2) @ x / n, bits, group)
    freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    basis = latent.layout(parts.up, parts.widths, freq)
    positions = torch.randint(0, 5000, (2, n), generator=g)
    keys = rotate(x, positions, freq)  # post-RoPE, as the cache holds them
    codes, meta = latent.encode(keys, basis, group, positions)
    assert codes.shape[-1] + 2 * meta.shape[-1] == latent.LatentCodec(bits, group).row_bytes(D), "the stated bytes"
    got = latent.latent_rows(codes, meta, basis)
    bound = latent.error_bound(keys, basis, group, positions)
    error = (got - latent.to_latent(keys, basis, positions)).abs()
    assert bool((error <= bound).all()), f"latent error {float((error - bound).max())} above its bound"
    rows = latent.decode(codes, meta, basis, positions)
    exact = rotate(latent.to_latent(keys, basis, positions) @ basis[:, :D], positions, freq)
    torch.testing.assert_close(rows, rotate(got @ basis[:, :D], positions, freq), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(exact, keys, atol=1e-3 * float(keys.abs().max()), rtol=1e-4)
    if bits == 8:  # 8 bits a channel on average: close to the rows themselves
        assert float((rows - keys).norm() / keys.norm()) < 0.02


def test_pack_unpack_is_bit_exact_for_any_widths():
    g = torch.Generator().manual_seed(fresh_seed())
    widths = torch.tensor([[8, 5, 3, 0], [4, 4, 4, 4], [0, 0, 8, 8]])
    q = torch.stack([torch.randint(0, 2**int(w), (7, 16), generator=g) if w else torch.zeros(7, 16, dtype=torch.long)
                     for row in widths for w in row]).view(3, 4, 7, 16).transpose(1, 2).to(torch.uint8)
    assert torch.equal(latent.unpack(latent.pack(q, widths), widths, 16), q)


def latent_pool(lengths, P: int, D: int, g: torch.Generator):
    """A one-layer pool of SPECTRA's rows (keys post-RoPE at their positions) whose heads hold ``lengths`` entries on
    shuffled pages, and what each head's entries decode to."""
    Hkv, width = len(lengths), max(2, -(-max(lengths) // P))
    ids = torch.randperm(Hkv * width, generator=g).reshape(1, Hkv, width) + 1
    N = Hkv * width + 1
    sample = correlated_rows(200, D, g, Hkv)
    parts = [spectra.basis(x.transpose(-1, -2) @ x / 200, 4, 16) for x in (sample, sample.flip(-1))]
    freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    basis = torch.stack([latent.layout(parts[0].up, parts[0].widths, freq),
                         latent.layout(parts[1].up, parts[1].widths)])
    page_pos = torch.zeros(N, P, dtype=torch.int32)
    for h in range(Hkv):
        page_pos[ids[0, h]] = torch.arange(width * P).int().view(width, P)
    owner = torch.zeros(N, dtype=torch.long)
    owner[ids[0].flatten()] = torch.arange(Hkv).repeat_interleave(width)
    rows = correlated_rows(N * P, D, g, 1)[0].view(N, P, D)
    k, km, v, vm = [], [], [], []
    for page in range(N):
        h = int(owner[page])
        kc, kmeta = latent.encode(rows[page][None], basis[0, h : h + 1], 16, page_pos[page][None].long())
        vc, vmeta = latent.encode(rows[page].flip(0)[None], basis[1, h : h + 1], 16)
        k, km, v, vm = k + [kc[0]], km + [kmeta[0]], v + [vc[0]], vm + [vmeta[0]]
    stored = reference.FormatPages(torch.stack(k), torch.stack(km), torch.stack(v), torch.stack(vm), page_pos,
                                   ids.int(), torch.tensor([lengths], dtype=torch.int32), basis)
    keys, values, positions, _ = stored.dense(D, torch.float32)
    return stored, [(keys[0, h, :n], values[0, h, :n], positions[0, h, :n]) for h, n in enumerate(lengths)]


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("T, window", [(1, 0), (1, 5), (4, 0), (4, 7)])
def test_attention_over_latent_pages_equals_dense_attention_over_the_decoded_rows(P, T, window):
    """Heads of lengths 1, P and P + 1 (GQA): the merged prefill attention, and the two-pass decode that mixes
    values in the latent basis and maps the sum, equal one softmax over the decoded keys and values."""
    g, D, Hq = torch.Generator().manual_seed(fresh_seed()), 16, 6
    lengths = [1, P, P + 1]
    stored, heads = latent_pool(lengths, P, D, g)
    start = max(lengths) * 2
    pool = (torch.zeros(2, P, D), torch.zeros(2, P, D), torch.zeros(2, P, dtype=torch.int32),
            torch.ones(1, 3, 1, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32))
    q = torch.randn(1, Hq, T, D, generator=g)
    q_pos = (start + torch.arange(T))[None]
    out = reference.paged_attention(q, q_pos, *pool, 0.3, window, stored=stored, block_bytes=64)
    for h in range(len(lengths)):
        assert_head_attends(out, q, q_pos, h, Hq // len(lengths), *heads[h], window, tol=1e-4)
    if T == 1 and window == 0:
        for tile in (1, P, 10**6):
            got = reference.stored_decode(q, reference.gather_dense(*pool), stored, 0.3, tile)
            torch.testing.assert_close(got, out, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- through the public API
@pytest.mark.parametrize("recipe, fmt", [("spectra", "spectra4"), ("saki", "saki4")])
def test_a_latent_format_stores_every_token_at_int4_bytes_and_stays_near_the_full_model(llama_cm, recipe, fmt):
    """``apply`` calibrates the basis (deterministic, so a second model gets the same one); every token is stored at
    int4's bytes, the basis is allocated and reported, and the next token stays near the full model's."""
    ids, mask = left_padded_batch([60, 47], total=60, seed=3)
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    nxt = full.prefill(ids, mask)[:, -1:].argmax(-1)
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["formats"][fmt]["tokens"] == stats["tokens_held"] == int(mask.sum()) * 3 * 2, "none evicted"
    int4 = kvcompile.apply(llama_cm, budget=0.25, recipe="full+int4", page_size=4)
    int4.prefill(ids, mask)
    assert stats["bytes_held"] == int4.cache_stats()["bytes_held"] <= stats["budget_bytes"], "int4's bytes"
    assert stats["bytes"]["tables"] >= cm.cache.fmt_basis.nbytes > 0, "the basis is allocated and reported"
    again = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    assert torch.equal(again.cache.fmt_basis, cm.cache.fmt_basis), "the calibration is deterministic"
    assert (cm.decode(nxt) - full.decode(nxt)).abs().max() < 0.5


def test_a_re_target_and_forks_keep_the_calibration_their_stored_rows_need(llama_cm):
    ids, mask = left_padded_batch([60, 47], total=60, seed=3)
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="spectra", page_size=4)
    shared = kvcompile.apply(cm, budget=0.1, recipe="snapkv+spectra4")
    assert shared.latent_moments is cm.latent_moments, "a re-target keeps the calibration"
    shared.prefill(ids, mask, compress=False)
    for recipe, budget in (("snapkv+spectra4", 0.1), ("spectra", 0.25)):
        child = shared.fork(recipe, budget=budget)
        child.compress()
        assert torch.equal(child.cache.fmt_basis, cm.cache.fmt_basis)
        assert child.cache_stats()["bytes_held"] <= child.cache_stats()["budget_bytes"]
        assert child.generate(ids, mask, max_new_tokens=4, eos_token_id=[]).shape[1] == ids.shape[1] + 4
