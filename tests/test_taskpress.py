"""TaskPress (inferred, docs/methods_scorers.md#taskpress): a meta-query's attention times each value's int4
quantization step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_plain_at_full_budget, byte_llama, byte_tokenizer, eager_attentions

import kvcompile
from kvcompile.kernels.formats import get_format
from kvcompile.methods.taskpress import value_scale
from kvcompile.recipes import anchors

N_SINK = 4


@pytest.fixture(scope="module")
def lm():
    return byte_llama(), byte_tokenizer()


def test_the_value_scale_is_the_step_an_int4_page_stores():
    """On fresh values with outlier channels, ``value_scale`` is the mean of the per-group steps the int4 codec
    writes (its fp16 rounding aside)."""
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(2, 3, 17, 64, generator=g) * torch.rand(64, generator=g).mul(8).exp2()
    _, meta = get_format("int4").value.encode(values)
    stored = meta.float().unflatten(-1, (-1, 2))[..., 0].mean(-1)
    torch.testing.assert_close(value_scale(values, 4, 32), stored, rtol=1e-3, atol=0, msg=f"seed {seed}")


def kept_positions(cm, layers: int):
    """{(layer, KV head): the positions row 0 holds}."""
    held = {}
    for layer in range(layers):
        _, _, pos, valid = cm.cache.dense(layer)
        for h in range(pos.shape[1]):
            held[layer, h] = set(pos[0, h][valid[0, h]].tolist())
    return held


def reference(scores, held) -> None:
    """Each (layer, KV head) holds its sinks and the top of ``scores`` [L, Hkv, n] for the count it holds, ties to
    the earlier token (a repeated token id has the same value in layer 0)."""
    for (layer, h), kept in held.items():
        s = scores[layer, h].clone()
        s[:N_SINK] = float("inf")
        top = s.sort(descending=True, stable=True).indices[:len(kept)]
        assert kept == set(top.tolist()), f"layer {layer}, head {h}"


def context(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 250, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scaled", [True, False])
def test_with_a_meta_query_it_keeps_the_top_attention_times_scale(lm, scaled):
    """Against the plain model over [context, meta-query]: per (layer, KV head), the kept tokens are the top of the
    meta-query's largest attention (over its tokens and the GQA group) times the value scale (``scaled=False``: the
    attention alone); the meta-query is gone afterwards, and the bytes are within the budget."""
    model, tok = lm
    recipe = anchors.resolve("taskpress", tok)
    if not scaled:
        recipe = dataclasses.replace(recipe, scorer_args={**recipe.scorer_args, "scaled": False})
    meta = torch.tensor([recipe.scorer_args["instruction_ids"]])
    assert tok.decode(meta[0]) == "Answer the question about the text above."
    n = 96
    ids = context(n, seed=3)
    cm = kvcompile.apply(model, budget=0.25, recipe=recipe, page_size=1)
    cm.prefill(ids)
    attn = torch.stack(eager_attentions(model, torch.cat([ids, meta], 1)))  # [L, 1, Hq, T, T]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    scale = torch.stack([value_scale(layer.values[0], 4, 32) for layer in cache.layers])  # [L, Hkv, n]
    probe = attn[:, 0, :, n:, :n].amax(2).unflatten(1, (2, 2)).amax(2)  # [L, Hkv, n]
    reference(probe * scale if scaled else probe, kept_positions(cm, 2))
    stats = cm.cache_stats()
    assert int(cm.seen[0]) == n and stats["bytes_held"] <= stats["budget_bytes"]


def test_without_a_meta_query_the_scale_alone_ranks_in_one_pass(lm):
    model, _ = lm
    recipe = dataclasses.replace(kvcompile.recipes()["taskpress"], scorer_args={"meta_query": ""})
    n = 96
    ids = context(n, seed=4)
    cm = kvcompile.apply(model, budget=0.25, recipe=recipe, page_size=1)
    cm.prefill(ids)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    reference(torch.stack([value_scale(layer.values[0], 4, 32) for layer in cache.layers]), kept_positions(cm, 2))
    stats = cm.cache_stats()
    assert stats["peak_bytes_held"] <= stats["bytes_full"], "no meta-query was read"
    assert stats["bytes_held"] <= stats["budget_bytes"]


def test_an_unresolved_meta_query_is_refused_and_resolve_fills_wrapped_ones(lm):
    model, tok = lm
    with pytest.raises(ValueError, match=r"kvcompile\.recipes\.anchors\.resolve\(recipe, tokenizer\)"):
        kvcompile.apply(model, budget=0.25, recipe="taskpress")
    kvcompile.apply(model, budget=0.25, recipe=kvcompile.recipes.anchors.resolve("taskpress", tok))  # as it says
    with pytest.raises(ValueError, match="none"):
        kvcompile.apply(model, budget=0.25, recipe=dataclasses.replace(
            kvcompile.recipes()["taskpress"], scorer_args={"meta_query": "", "instruction_ids": (5, 6)}))
    chunked = anchors.resolve("chunkkv+taskpress", tok)
    assert chunked.scorer_args["base_args"]["instruction_ids"] == tuple(tok.encode(
        "Answer the question about the text above.", add_special_tokens=False))
    given = dataclasses.replace(kvcompile.recipes()["taskpress"], scorer_args={"instruction_ids": (7, 8)})
    assert anchors.resolve(given, tok) == given
    assert anchors.resolve("snapkv", tok) == kvcompile.recipes()["snapkv"]


def test_stored_in_int4_it_holds_the_budget_and_generates(lm):
    model, tok = lm
    cm = kvcompile.apply(model, budget=0.25, recipe=anchors.resolve("taskpress+int4", tok), page_size=4)
    cm.prefill(context(120, seed=5))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert cm.generate(context(6, seed=6), max_new_tokens=3, eos_token_id=[]).shape == (1, 9)


def test_at_full_budget_it_is_the_plain_model(lm):
    model, tok = lm
    assert_plain_at_full_budget(model, model, anchors.resolve("taskpress", tok))
