"""Declared observation sources: what a method reads beyond keys and values is declared by the method and
supplied by the runtime (token ids, layer weights, hidden states), or refused at apply, naming the source."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import left_padded_batch

import kvcompile
from kvcompile.methods.base import ContextTokens, ExtraPass, HiddenStates, LayerWeights, Scorer, register_scorer

SEEN: dict = {}


@register_scorer("reads-ids-and-wo")
@dataclass
class ReadsIdsAndWO(Scorer):
    """Keeps the tokens with the largest ids; records what it was given."""

    def sources(self):
        return ContextTokens(), LayerWeights("o_proj")

    def score(self, obs):
        SEEN[obs.layer] = (obs.token_ids, obs.positions, obs.valid, obs.weights["o_proj"])
        return obs.token_ids.float()


@register_scorer("reads-hidden-states")
@dataclass
class ReadsHiddenStates(Scorer):
    """Keeps the tokens whose attention input has the largest first channel; records what it was given."""

    def sources(self):
        return (HiddenStates(),)

    def score(self, obs):
        SEEN[("hidden", obs.layer)] = (obs.hidden, obs.positions, obs.valid)
        return obs.hidden[..., 0]


@register_scorer("reads-an-extra-pass")
@dataclass
class ReadsExtraPass(Scorer):
    def sources(self):
        return (ExtraPass(),)

    def score(self, obs):
        raise AssertionError("never called")


def test_token_ids_and_output_projection_are_supplied(llama, llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("ids", "reads-ids-and-wo"), page_size=4)
    ids, mask = left_padded_batch([40, 29], total=40)
    cm.prefill(ids, mask)
    for layer, (token_ids, positions, valid, w_o) in SEEN.items():
        assert w_o is llama.model.layers[layer].self_attn.o_proj.weight
        for b, n in enumerate([40, 29]):
            real = ids[b, 40 - n :]
            held = positions[b][valid[b]]
            assert torch.equal(token_ids[b][valid[b]], real[held]), f"layer {layer} row {b}: the ids of the held tokens"
    for b, n in enumerate([40, 29]):  # the scores were the ids: each head kept its largest ones
        _, _, pos, valid = cm.cache.dense(0)
        kept = ids[b, 40 - n :][pos[b, 0][valid[b, 0]]]
        assert kept.min() >= ids[b, 40 - n :].sort(descending=True).values[len(kept) - 1]
    assert cm.cache_stats()["bytes"]["tables"] >= ids.numel() * 8, "the token log is counted"


def test_hidden_states_are_each_layers_attention_input_at_the_held_positions(llama, llama_cm):
    """Against the plain model: layer l's attention input is its input norm of the residual stream entering it."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("hidden", "reads-hidden-states"), page_size=4)
    ids, mask = left_padded_batch([40, 29], total=40, seed=5)
    cm.prefill(ids, mask)
    with torch.no_grad():
        out = llama(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0),
                    output_hidden_states=True)
    for layer, block in enumerate(llama.model.layers):
        hidden, positions, valid = SEEN[("hidden", layer)]
        want = block.input_layernorm(out.hidden_states[layer])  # [B, T, hidden]
        for b, n in enumerate([40, 29]):
            got = hidden[b][valid[b]]  # [held, hidden]
            torch.testing.assert_close(got, want[b, 40 - n:][positions[b][valid[b]]], atol=1e-5, rtol=1e-5)
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]


def test_hidden_states_need_the_context_in_one_prefill(llama_cm):
    recipe = kvcompile.Recipe("hidden", "reads-hidden-states")
    with pytest.raises(ValueError, match="dense pass of the source model"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=recipe, prefill_chunk=16)
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=recipe, page_size=4)
    ids, _ = left_padded_batch([40], total=40)
    cm.prefill(ids)
    with pytest.raises(ValueError, match="dense pass over every token the cache read"):
        cm.prefill(ids[:, :8])


def test_a_source_not_supplied_yet_is_refused_at_apply(llama_cm):
    with pytest.raises(NotImplementedError, match="reads ExtraPass, which kvcompile does not supply yet"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("extra", "reads-an-extra-pass"))


def test_a_fork_that_reads_ids_needs_a_parent_that_logged_them(llama_cm):
    parent = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)
    parent.prefill(left_padded_batch([40], total=40)[0], compress=False)
    with pytest.raises(ValueError, match="token ids of the context"):
        parent.fork(kvcompile.Recipe("ids", "reads-ids-and-wo"), 0.5)
