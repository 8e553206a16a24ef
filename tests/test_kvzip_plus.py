"""KVzip+ and the ProbeInputNorms source: the probes' input norms are the model's and reach the scorer at the right
window slots, the score is its formula, and the recipe holds its budget and is the model at budget 1.0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import assert_plain_at_full_budget, left_padded_batch

import kvcompile
from kvcompile.methods import Observation
from kvcompile.methods.base import register_scorer
from kvcompile.methods.kvzip_plus import KVzipPlus

SEEN: dict = {}


@register_scorer("records-probe-norms")
@dataclass
class RecordsProbeNorms(KVzipPlus):
    """KVzip+ that records the probe norms and query positions it was given."""

    def score(self, obs):
        SEEN[obs.layer] = (obs.query_input_norms.clone(), obs.query_positions.clone())
        return super().score(obs)


def test_the_window_slots_read_the_input_norms_of_their_probes(llama, llama_cm):
    SEEN.clear()
    recipe = kvcompile.Recipe("records", "records-probe-norms", "global-topk", {"n_sink": 4, "window": 256})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([40, 29], total=40)
    cm.prefill(ids, mask)
    # the reconstruction prompt is the context again: the probes are the second copy, at positions n .. 2n - 1
    full, real = torch.cat([ids, ids], 1), torch.cat([mask, mask], 1).bool()
    hooked = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, k: hooked.append(k["hidden_states"][0]),
                                                        with_kwargs=True) for layer in llama.model.layers]
    try:
        for b in range(2):  # each row alone, unpadded: the model's own attention inputs
            hooked.clear()
            row = full[b, real[b]][None]
            with torch.no_grad():
                llama(input_ids=row)
            for layer, (norms, q_pos) in SEEN.items():
                for slot, p in enumerate(q_pos[b].tolist()):
                    expected = 0.0 if p < 0 else float(hooked[layer][p].norm())
                    torch.testing.assert_close(float(norms[b, slot]), expected, rtol=1e-4, atol=1e-5)
    finally:
        for h in hooks:
            h.remove()
    assert {p for _, q in SEEN.values() for p in q[0].tolist() if p >= 0} == set(range(40, 80)), "probes only"


def test_score_is_normalised_attention_times_output_norm():
    seed = int(torch.randint(0, 2**31, ()))
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, S, W, D, hidden = 1, 2, 2, 10, 4, 8, 12
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    queries = torch.randn(B, Hkv * G, W, D, generator=g)
    positions = torch.arange(S).expand(B, Hkv, S)
    q_pos = torch.arange(S, S + W).expand(B, W)  # the probes, after the held tokens
    h_norms = torch.rand(B, W, generator=g) * 3 + 0.1
    w_o = torch.randn(hidden, Hkv * G * D, generator=g)
    obs = Observation(keys, values, positions, torch.ones(B, Hkv, S, dtype=torch.bool), queries, q_pos, D**-0.5, 0,
                      0, 1, weights={"o_proj": w_o}, query_input_norms=h_norms)
    scores = KVzipPlus(n_sink=0).score(obs)
    for h in range(Hkv):
        best = torch.zeros(S)
        for r in range(h * G, (h + 1) * G):
            attn = torch.softmax(queries[0, r] @ keys[0, h].T * D**-0.5, -1)  # [W, S]
            out_norm = (values[0, h] @ w_o[:, r * D : (r + 1) * D].T).norm(dim=-1)  # [S]
            best = torch.maximum(best, (attn / h_norms[0, :, None]).amax(0) * out_norm)
        torch.testing.assert_close(scores[0, h], best, rtol=1e-5, atol=1e-6)


def test_kvzip_plus_runs_by_name_within_budget_and_full_budget_is_the_model(llama, llama_cm):
    assert_plain_at_full_budget(llama, llama_cm, "kvzip-plus")
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="kvzip-plus", page_size=4)
    cm.prefill(*left_padded_batch([70, 50], total=70))
    stats = cm.cache_stats()
    assert 0 < stats["bytes_held"] <= stats["budget_bytes"]
