"""SAKI (docs/methods_formats.md#saki): the rank-r key index against its specification (Prop. 1's optimum and residual,
the factored score, exactness at full rank) and its recall report on a model."""

from __future__ import annotations

import pytest
import torch

from kvcompile.calibration import saki as calibration
from kvcompile.methods.saki import key_pca, moments, saki, score_error, topk_recall


def _data(seed: int, D: int = 16):
    g = torch.Generator().manual_seed(seed)
    mix_q, mix_k = (torch.randn(D, D, generator=g, dtype=torch.float64) for _ in range(2))
    queries = torch.randn(3000, D, generator=g, dtype=torch.float64) @ mix_q
    keys = torch.randn(2000, D, generator=g, dtype=torch.float64) @ mix_k + torch.randn(D, generator=g) * 3
    keys[:, 3] *= 20  # an outlier channel, as keys have
    return queries, keys


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_index_attains_its_predicted_error_and_beats_key_pca_at_every_rank(seed):
    """Prop. 1: over every (query, key) pair of the calibration data, the mean-square score error of SAKI's map
    equals the residual ``Σ_{i>r} λ_i²`` it predicts, is no more than key PCA's at the same rank, and is 0 at full
    rank; the codes read by a query give the same scores as the reconstructed keys."""
    queries, keys = _data(seed)
    sigma_q, sigma_k, mean = moments(queries, keys)
    exact, gap = queries @ (keys - mean).T, {}
    for rank in (0, 1, 4, 8, 15, 16):
        maps, predicted = saki(sigma_q, sigma_k, mean, rank)
        measured = (exact - queries @ (maps.reconstruct(keys) - mean).T).square().mean()
        pca = key_pca(sigma_k, mean, rank)
        pca_error = (exact - queries @ (pca.reconstruct(keys) - mean).T).square().mean()
        scale = exact.square().mean()
        assert abs(measured - predicted) <= 1e-8 * scale, f"seed {seed}, rank {rank}"
        assert abs(score_error(maps, sigma_q, sigma_k) - measured) <= 1e-8 * scale
        assert measured <= pca_error + 1e-9 * scale, f"seed {seed}, rank {rank}: SAKI above PCA"
        assert maps.codes(keys).shape == (2000, rank)
        gap[rank] = float(pca_error - measured)
        torch.testing.assert_close(maps.scores(queries[:5], maps.codes(keys[:7])), queries[:5] @ maps.reconstruct(
            keys[:7]).T)
    assert measured <= 1e-10 * scale  # full rank: exact
    assert gap[4] > 1e-6 * float(scale) and gap[8] > 1e-6 * float(scale)  # strictly better at low rank


def test_topk_recall_counts_the_overlap_of_the_two_top_sets():
    exact = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    approx = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert float(topk_recall(exact, approx, 2)) == pytest.approx((1 / 2 + 2 / 2) / 2)
    valid = torch.tensor([[True, True, True, False, False], [True, False, False, False, False]])
    assert float(topk_recall(exact, approx, 2, valid)) == pytest.approx(1 / 2)  # the second row sees one key: out


def test_recall_on_a_model_is_exact_at_full_rank(llama_cm):
    """On the tiny llama (pre-RoPE moments from its own prefill, recall on other tokens): one row per (method,
    rank, layer, KV head); at full rank both indexes recover every top-k set (so un-rotating, mapping and rotating
    back loses nothing), at rank 2 neither does. Which one recalls more on real text is the bench's question
    (``bench/saki.py``): Prop. 1 bounds the score error on the calibration moments, not recall elsewhere."""
    g = torch.Generator().manual_seed(5)
    calib = [torch.randint(2, 90, (1, 96), generator=g) for _ in range(2)]
    held_out = [torch.randint(2, 90, (1, 80), generator=g)]
    stats = calibration.calibrate(llama_cm, calib)
    D = llama_cm.spec.head_dim
    rows = calibration.recall(llama_cm, stats, held_out, ranks=[2, D], k=8, n_queries=32)
    assert {(r["method"], r["rank"]) for r in rows} == {(m, r) for m in ("saki", "pca") for r in (2, D)}
    assert len(rows) == 4 * llama_cm.spec.num_layers * llama_cm.spec.num_kv_heads
    assert min(r["recall"] for r in rows if r["rank"] == D) == pytest.approx(1.0)
    assert max(r["recall"] for r in rows if r["rank"] == 2) < 1.0
    with pytest.raises(ValueError, match="samples must be a non-empty list"):
        calibration.calibrate(llama_cm, [])
