"""Scorers that kvpress computes before RoPE (expected-attention, cappress, leverage-score, compactor): the
observation rotates the cache's post-RoPE keys and queries back, and averages the rotation over future positions,
against transformers' own rotary embedding (the seed is printed; TEST_SEED=<seed> replays a failure)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import transformers as tf
from conftest import left_padded_batch, tiny_model
from test_scorers import exact_leverage, make_obs

import kvcompile
from kvcompile.methods import SCORERS
from kvcompile.methods.rope import future_rotation, pre_rope
from kvcompile.observation import observe

D = 8


@pytest.fixture
def seed():
    s = int(os.environ.get("TEST_SEED", random.randrange(2**31)))
    print(f"seed = {s}")
    return s


def rope(theta=10000.0):
    """transformers' Llama rotary embedding for head dim D: (inv_freq, cos_sin(positions) -> [N, D] each)."""
    cfg = tf.LlamaConfig(hidden_size=2 * D, num_attention_heads=2, head_dim=D, rope_theta=theta)
    emb = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    return emb.inv_freq, lambda pos: [t[0] for t in emb(torch.zeros(1), pos[None])]


def apply_rope(x, positions, cos_sin):
    """x [..., N, D] at ``positions`` [N] with transformers' apply_rotary_pos_emb (rotate-half)."""
    cos, sin = cos_sin(positions)
    return x * cos + tf.models.llama.modeling_llama.rotate_half(x) * sin


def rotated_obs(seed, S=40, W=40):
    """make_obs whose keys and queries are post-RoPE images of known pre-RoPE ones (returned too)."""
    inv_freq, cos_sin = rope()
    obs = make_obs(S=S, W=W, D=D, seed=seed)
    k0, q0 = obs.keys.clone(), obs.queries.clone()
    obs.keys = apply_rope(k0, obs.positions[0, 0], cos_sin)
    obs.queries = apply_rope(q0, obs.query_positions[0], cos_sin)
    return dataclasses.replace(obs, weights={"inv_freq": inv_freq}), k0, q0, cos_sin


def test_pre_rope_undoes_transformers_rope(seed):
    obs, k0, q0, _ = rotated_obs(seed)
    torch.testing.assert_close(pre_rope(obs, obs.keys, obs.positions), k0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre_rope(obs, obs.queries, obs.query_positions[:, None]), q0, rtol=1e-5, atol=1e-5)
    plain = make_obs(seed=seed)  # no rotary frequencies known: taken as they are
    assert pre_rope(plain, plain.keys, plain.positions) is plain.keys


def test_future_rotation_is_the_mean_of_transformers_rotations(seed):
    obs, *_ , cos_sin = rotated_obs(seed, S=30, W=12)
    cos, sin = cos_sin(torch.arange(30, 30 + 64))  # the 64 positions after the last query (29)
    half = torch.zeros(D, D)
    half[D // 2:, : D // 2], half[: D // 2, D // 2:] = torch.eye(D // 2), -torch.eye(D // 2)  # rotate_half as a matrix
    ref = (cos[:, :, None] * torch.eye(D) + sin[:, :, None] * half).mean(0)
    torch.testing.assert_close(future_rotation(obs, 64)[0].float(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(future_rotation(make_obs(D=D), 64)[0], torch.eye(D, dtype=torch.float64))


def test_expected_attention_models_pre_rope_queries_moved_to_the_future(seed):
    """Expected attention (docs/methods_scorers.md#expected-attention) as kvpress computes it, written out from the
    pre-RoPE queries."""
    obs, _, q0, cos_sin = rotated_obs(seed)
    n_sink, n_future = 4, 16
    q = q0[:, :, n_sink:].double()  # every observed query is after the sinks but the first 4
    mu = q.mean(2)
    cov = torch.einsum("bhwi,bhwj->bhij", q - mu[:, :, None], q - mu[:, :, None]) / q.shape[2]
    cos, sin = cos_sin(torch.arange(40, 40 + n_future))
    half = torch.zeros(D, D)
    half[D // 2:, : D // 2], half[: D // 2, D // 2:] = torch.eye(D // 2), -torch.eye(D // 2)
    R = (cos[:, :, None] * torch.eye(D) + sin[:, :, None] * half).mean(0).double()
    mu, cov = mu @ R.T, R @ cov @ R.T
    keys = obs.keys.double().repeat_interleave(2, 1)[:, :, n_sink:]
    z = keys @ mu[..., None] / D**0.5
    z = z[..., 0] + 0.5 * ((keys @ cov) * keys).sum(-1) / D
    ref = torch.softmax(z, -1).reshape(1, 2, 2, -1).mean(2) * obs.values[:, :, n_sink:].double().norm(dim=-1)
    scores = SCORERS["expected-attention"](window=40, n_sink=n_sink, n_future_positions=n_future).score(obs)
    torch.testing.assert_close(scores[:, :, n_sink:].double(), ref, rtol=1e-4, atol=1e-7)


def test_leverage_scorers_read_the_keys_before_rope(seed):
    """leverage-score is the z-scored leverage of the pre-RoPE keys; RoPE moves the post-RoPE one."""
    obs, k0, *_ = rotated_obs(seed)
    scores = SCORERS["leverage-score"](seed=seed).score(obs)
    for h in range(2):
        lev = exact_leverage(k0[0, h])
        torch.testing.assert_close(scores[0, h], ((lev - lev.mean()) / lev.std(unbiased=False)).float(),
                                   rtol=1e-4, atol=1e-4)
    post = SCORERS["leverage-score"](seed=seed).score(dataclasses.replace(obs, weights={}))
    assert not torch.allclose(post, scores, atol=1e-2), "post-RoPE keys would rank differently"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_captured_model_hands_its_rotary_frequencies_to_the_scorers(family):
    """On a real model the observation's pre-RoPE keys are the layer's own key projections (k_norm included)."""
    model = tiny_model(family)
    cm = kvcompile.apply(model, budget=1.0, recipe="expected-attention", page_size=4)
    ids, mask = left_padded_batch([24], total=24, seed=3)
    inputs = {}
    attention = model.model.layers[1].self_attn
    hook = attention.register_forward_pre_hook(lambda m, a, kw: inputs.update(h=kw["hidden_states"]),
                                               with_kwargs=True)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    hook.remove()
    k = attention.k_proj(inputs["h"]).view(1, 24, -1, attention.head_dim)
    k = (attention.k_norm(k) if hasattr(attention, "k_norm") else k).transpose(1, 2)
    cm.prefill(ids, mask, compress=False)
    obs = observe(cm.cache, cm.programs.layers[1])
    assert "inv_freq" in obs.weights
    torch.testing.assert_close(pre_rope(obs, obs.keys, obs.positions), k, rtol=1e-4, atol=1e-4)
