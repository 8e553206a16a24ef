"""KVgrad and the Gradients source: the gradient norms are the model's, they reach the scorer at the right window
slots, the score is its formula, and what a backward pass over the context cannot do is refused up front."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import left_padded_batch

import kvcompile
from kvcompile.gradients import attention_output_gradients
from kvcompile.methods import Observation
from kvcompile.methods.base import register_scorer
from kvcompile.methods.kvgrad import KVgrad

SEEN: dict = {}


@register_scorer("records-gradients")
@dataclass
class RecordsGradients(KVgrad):
    """KVgrad that records the gradients and query positions it was given."""

    def score(self, obs):
        SEEN[obs.layer] = (obs.query_gradients.clone(), obs.query_positions.clone())
        return super().score(obs)


def _phi(model, ids, real, probes, nudge=None):
    """Phi = sum of ||h_p^L||^2 over probes, with ``nudge`` = (layer, row, token, vector) added to that attention
    output."""
    layers, last, hooks = model.model.layers, [], []
    if nudge is not None:
        layer, b, t, vec = nudge

        def add(module, args, out):
            out[0][b, t] += vec
            return out

        hooks.append(layers[layer].self_attn.register_forward_hook(add))
    hooks.append(layers[-1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple)
                                                                                 else out)))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=real.long(), position_ids=(real.long().cumsum(1) - 1).clamp_min(0))
    for h in hooks:
        h.remove()
    return float((last[0].pow(2).sum(-1) * probes).sum())


def test_gradient_norms_match_finite_differences(llama):
    model = copy.deepcopy(llama).double()
    ids, mask = left_padded_batch([12, 9], total=12, seed=3)
    real = mask.bool()
    probes = real.clone()
    probes[:, :8] = False
    norms = attention_output_gradients(model, ids, real, probes)
    assert norms.shape == (3, 2, 12) and (norms[:, ~real] == 0).all()
    eps, hidden = 1e-3, model.config.hidden_size  # RMSNorm computes in float32 even in a double model
    for layer, b, t in [(0, 0, 3), (2, 1, 10)]:
        grad = torch.zeros(hidden, dtype=torch.float64)
        for k in range(hidden):
            e = torch.zeros(hidden, dtype=torch.float64)
            e[k] = eps
            grad[k] = (_phi(model, ids, real, probes, (layer, b, t, e)) -
                       _phi(model, ids, real, probes, (layer, b, t, -e))) / (2 * eps)
        torch.testing.assert_close(norms[layer, b, t].double(), grad.norm(), rtol=1e-3, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters()), "the weights are left as they were"
    assert all(p.grad is None for p in model.parameters())


def test_the_window_slots_read_the_gradients_of_their_probes(llama, llama_cm):
    SEEN.clear()
    recipe = kvcompile.Recipe("records", "records-gradients", "global-topk", {"n_sink": 4, "window": 256})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([40, 29], total=40)
    cm.prefill(ids, mask)
    # the reconstruction prompt is the context again: the probes are the second copy
    full, real = torch.cat([ids, ids], 1), torch.cat([mask, mask], 1).bool()
    probes = real.clone()
    probes[:, :40] = False
    expected = attention_output_gradients(llama, full, real, probes)
    positions = (real.long().cumsum(1) - 1).clamp_min(0)
    for layer, (grads, q_pos) in SEEN.items():
        for b in range(2):
            for slot, p in enumerate(q_pos[b].tolist()):
                if p < 0:
                    assert grads[b, slot] == 0
                    continue
                t = int(((positions[b] == p) & real[b]).nonzero()[0])
                torch.testing.assert_close(grads[b, slot], expected[layer, b, t], rtol=1e-4, atol=1e-6)
    assert {p for _, q in SEEN.values() for p in q[0].tolist() if p >= 0} == set(range(40, 80)), "probes only"


def test_score_is_gradient_weighted_attention_times_output_norm():
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S, W, D, hidden = 1, 2, 2, 10, 4, 8, 12
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    queries = torch.randn(B, Hkv * G, W, D, generator=g)
    positions = torch.arange(S).expand(B, Hkv, S)
    q_pos = torch.arange(S, S + W).expand(B, W)  # the probes, after the held tokens
    grads = torch.rand(B, W, generator=g) + 0.1
    w_o = torch.randn(hidden, Hkv * G * D, generator=g)
    obs = Observation(keys, values, positions, torch.ones(B, Hkv, S, dtype=torch.bool), queries, q_pos, D**-0.5, 0,
                      0, 1, weights={"o_proj": w_o}, query_gradients=grads)
    scores = KVgrad(n_sink=0).score(obs)
    for h in range(Hkv):
        best = torch.zeros(S)
        for r in range(h * G, (h + 1) * G):
            attn = torch.softmax(queries[0, r] @ keys[0, h].T * D**-0.5, -1)  # [W, S]
            out_norm = (values[0, h] @ w_o[:, r * D : (r + 1) * D].T).norm(dim=-1)  # [S]
            best = torch.maximum(best, (attn * grads[0, :, None]).amax(0) * out_norm)
        torch.testing.assert_close(scores[0, h], best, rtol=1e-5, atol=1e-6)


def test_kvgrad_runs_by_name_within_budget_and_full_budget_is_the_model(llama, llama_cm):
    from conftest import assert_plain_at_full_budget

    assert_plain_at_full_budget(llama, llama_cm, "kvgrad")
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="kvgrad", page_size=4)
    cm.prefill(*left_padded_batch([70, 50], total=70))
    stats = cm.cache_stats()
    assert 0 < stats["bytes_held"] <= stats["budget_bytes"]


def test_what_one_backward_pass_cannot_replay_is_refused_before_anything_changes(llama_cm):
    with pytest.raises(ValueError, match="not with prefill_chunk"):
        kvcompile.apply(llama_cm, budget=0.25, recipe="kvgrad", prefill_chunk=16)
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="kvgrad", page_size=4)
    ids, _ = left_padded_batch([60], total=60)
    cm.prefill(ids)
    before = cm.cache_stats()
    with pytest.raises(ValueError, match="was compressed before"):
        cm.prefill(ids[:, :8])
    assert cm.cache_stats() == before, "the refused call leaves the cache as it was"
    cm.prefill(ids[:, :8], compress=False)  # a question read after the compression is fine
    assert cm.cache_stats()["bytes_held"] > before["bytes_held"]
