"""Key re-rotation: against transformers' own RoPE, and end to end through ``key-rerotation+<recipe>``."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_seed, left_padded_batch, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvcompile
from kvcompile.methods.rope import rotate
from kvcompile.spec import ModelSpec

SEED = fresh_seed()


def hf_rope(model, x, positions, layer_type=None):
    """x [1, H, S, D] rotated to ``positions`` [S] by the model's own rotary embedding."""
    rotary = model.model.rotary_emb
    args = (x, positions[None]) + ((layer_type,) if layer_type else ())
    cos, sin = rotary(*args)
    return apply_rotary_pos_emb(x, x, cos, sin)[1]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rotating_a_post_rope_key_equals_transformers_rope_at_the_new_position(family):
    """Gemma-3 has two RoPEs (local and global layers): each layer's frequencies come from its own."""
    g = torch.Generator().manual_seed(SEED)
    model = tiny_model(family)
    spec = ModelSpec.from_model(model)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * spec.num_layers
    old, new = torch.randint(0, 500, (20,), generator=g), torch.randint(0, 500, (20,), generator=g)
    for layer, layer_type in enumerate(types):
        x = torch.randn(1, 2, 20, spec.head_dim, generator=g)
        kind = layer_type if family == "gemma3" else None
        at_old, at_new = hf_rope(model, x, old, kind), hf_rope(model, x, new, kind)
        moved = rotate(at_old, (new - old).expand(1, 2, 20), torch.tensor(spec.rotary[layer]))
        assert torch.allclose(moved, at_new, atol=2e-4), f"seed {SEED}, layer {layer}"  # fp32 angles up to 500 rad


def test_rotations_compose_and_leave_unrotated_channels_alone():
    g = torch.Generator().manual_seed(SEED)
    keys, delta = torch.randn(3, 7, 12, generator=g), torch.randint(-300, 300, (3, 7), generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)  # rotary dim 8 of 12: partial rotary
    back = rotate(rotate(keys, delta, inv_freq), -delta, inv_freq)
    assert torch.allclose(back, keys, atol=1e-5), f"seed {SEED}"
    assert torch.equal(rotate(keys, delta, inv_freq)[..., 8:], keys[..., 8:])


def test_kept_keys_sit_right_before_the_next_query_with_kvpress_distances(llama_cm):
    """Same selection as the plain recipe (KNorm ignores positions); every head's keys are its kept keys rotated to
    contiguous positions ending at the row's last token, so a query at the next position sees kvpress's distances
    (key m of n at distance n - m)."""
    ids, mask = left_padded_batch([80, 57], total=80, seed=7)
    moved = kvcompile.apply(llama_cm, budget=0.3, recipe="key-rerotation+knorm")
    plain = kvcompile.apply(llama_cm, budget=0.3, recipe="knorm")
    moved.prefill(ids, mask)
    plain.prefill(ids, mask)
    assert moved.cache_stats()["bytes_held"] <= moved.cache_stats()["budget_bytes"]
    seen = torch.tensor([80, 57])
    for layer, inv_freq in enumerate(moved.spec.rotary):
        k0, v0, p0, valid = plain.cache.dense(layer)
        k1, v1, p1, valid1 = moved.cache.dense(layer)
        assert torch.equal(valid, valid1) and torch.equal(v0, v1)
        n = valid.sum(-1)
        for b in range(2):
            for h in range(2):
                want = torch.arange(int(seen[b] - n[b, h]), int(seen[b]))
                assert torch.equal(p1[b, h][valid[b, h]].sort().values, want), f"layer {layer}, row {b}, head {h}"
        delta = (p1 - p0).masked_fill(~valid, 0)
        assert torch.allclose(k1[valid], rotate(k0, delta, torch.tensor(inv_freq))[valid], atol=1e-5)


def test_decoding_after_rerotation_is_kvpress_with_keys_at_0_to_n(llama):
    """kvpress's convention as the oracle: the kept keys re-rotated to positions 0..n-1 in a transformers cache and
    the next token read at position n give the same logits as kvcompile's right-aligned keys and unmoved query.
    (Uniform KNorm keeps the same count in every head, which a transformers cache needs.)"""
    from transformers import DynamicCache

    ids, mask = left_padded_batch([64], total=64, seed=8)
    cm = kvcompile.apply(llama, budget=0.25, recipe="key-rerotation+knorm")
    plain = kvcompile.apply(cm, budget=0.25, recipe="knorm")
    cm.prefill(ids, mask)
    plain.prefill(ids, mask)
    token = torch.tensor([[5]])
    cache = DynamicCache()
    for layer, inv_freq in enumerate(cm.spec.rotary):
        keys, values, positions, valid = plain.cache.dense(layer)
        n = int(valid.sum(-1).max())
        assert (valid.sum(-1) == n).all(), "one count per head"
        keys, values, positions = keys[:, :, :n], values[:, :, :n], positions[:, :, :n]
        order = positions.argsort(-1)
        keys, values, positions = (x.gather(2, order[..., None].expand_as(x)) if x.dim() == 4 else x.gather(2, order)
                                   for x in (keys, values, positions))
        to = torch.arange(positions.shape[-1]).expand_as(positions)
        cache.update(rotate(keys, to - positions, torch.tensor(inv_freq)), values, layer)
    n = int(positions.shape[-1])
    with torch.no_grad():
        want = llama(input_ids=token, position_ids=torch.tensor([[n]]), cache=cache).logits
    got = cm.decode(token)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(plain.decode(token), want, atol=1e-3), "without re-rotation the gaps stay"


def test_rerotation_is_refused_where_it_cannot_be_exact(llama_cm):
    with pytest.raises(ValueError, match="decode schedule or prefill_chunk"):
        kvcompile.apply(llama_cm, budget=64, recipe="key-rerotation+inertiakv")
    with pytest.raises(ValueError, match="decode schedule or prefill_chunk"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="key-rerotation+knorm", prefill_chunk=32)


def test_a_model_without_readable_rotary_frequencies_is_refused():
    from test_plain_module import TinyGPT  # learned absolute positions: nothing to re-rotate

    with pytest.raises(ValueError, match="no rotary embedding buffers"):
        kvcompile.apply(TinyGPT().eval(), budget=0.5, recipe="key-rerotation+knorm")
