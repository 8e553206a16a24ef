"""Declared observation sources: what a method reads beyond keys and values is declared by the method and
supplied by the runtime (token ids, layer weights), or refused at apply, naming the source."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import left_padded_batch

import kvcompile
from kvcompile.methods.base import ContextTokens, HiddenStates, LayerWeights, Scorer, register_scorer

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
    def sources(self):
        return (HiddenStates(),)

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


def test_a_source_not_supplied_yet_is_refused_at_apply(llama_cm):
    with pytest.raises(NotImplementedError, match="reads HiddenStates, which kvcompile does not supply yet"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("hidden", "reads-hidden-states"))


def test_a_fork_that_reads_ids_needs_a_parent_that_logged_them(llama_cm):
    parent = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)
    parent.prefill(left_padded_batch([40], total=40)[0], compress=False)
    with pytest.raises(ValueError, match="token ids of the context"):
        parent.fork(kvcompile.Recipe("ids", "reads-ids-and-wo"), 0.5)
