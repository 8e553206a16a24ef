"""Speculative decoding with a compressed draft (``generate(..., draft=...)``, inferred): the output is
the target's own, greedy token for token and sampled in distribution, and both caches end as if nothing had been
drafted."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, byte_llama, tiny_model

import kvcompile
from kvcompile.speculative import acceptance, distribution, residual


@pytest.fixture(scope="module")
def other_draft():
    """Another model over the same vocabulary (a different random llama), compressed."""
    return kvcompile.apply(tiny_model("llama", seed=1, layers=2), budget=0.3, recipe="snapkv", page_size=4)


def prompt(seed: int, length: int = 32) -> torch.Tensor:
    return torch.randint(2, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def drafts(llama_cm, other_draft) -> dict:
    return {"snapkv@0.3": kvcompile.apply(llama_cm, budget=0.3, recipe="snapkv", page_size=4),
            "another model": other_draft}


@pytest.mark.parametrize("target_recipe, seeds", [(("full", 1.0), (0, 1)), (("knorm", 0.5), (3,))],
                         ids=["full", "knorm@0.5"])
def test_greedy_speculation_is_the_target_token_for_token(llama_cm, other_draft, target_recipe, seeds):
    """k in {1, 3, 5}, several prompts and drafts, with an eos id taken from the target's own output (generation
    stops early) and without; the target's cache then ends holding what plain decoding leaves in it."""
    target = kvcompile.apply(llama_cm, budget=target_recipe[1], recipe=target_recipe[0], page_size=4)
    for seed in seeds:
        ids = prompt(seed)
        free = target.generate(ids, max_new_tokens=16, eos_token_id=[])
        eos = [int(free[0, -6])] if seed % 2 else []
        want = target.generate(ids, max_new_tokens=16, eos_token_id=eos)
        held = target.cache_stats()
        assert want.shape[1] < free.shape[1] or not eos
        for name, draft in drafts(llama_cm, other_draft).items():
            for k in (1, 3, 5):
                got = target.generate(ids, max_new_tokens=16, eos_token_id=eos, draft=draft, draft_tokens=k)
                assert torch.equal(got, want), f"seed {seed}, eos {eos}, draft {name}, k={k}"
                stats = target.cache_stats()  # without eos (plain decoding reads on past one for a while)
                assert eos or (stats["lengths"], stats["bytes_held"]) == (held["lengths"], held["bytes_held"]), \
                    f"seed {seed}: the target's cache kept rejected drafts"


def test_context_ids_are_read_apart_by_both_models(llama_cm):
    """Query-agnostic: the draft compresses the context before it reads the question, as the target does."""
    target = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    draft = kvcompile.apply(llama_cm, budget=0.3, recipe="snapkv", page_size=4)
    context, question = prompt(5), prompt(6, 6)
    want = target.generate(question, context_ids=context, max_new_tokens=12, eos_token_id=[])
    got = target.generate(question, context_ids=context, max_new_tokens=12, eos_token_id=[], draft=draft)
    assert torch.equal(got, want)
    assert (target.cache_stats()["query_aware"], draft.cache_stats()["query_aware"]) == (False, False)


def test_a_draft_that_is_the_target_keeps_every_proposal(llama_cm):
    target = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    draft = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    target.generate(prompt(3), max_new_tokens=22, eos_token_id=[], draft=draft, draft_tokens=4)
    stats = target.speculation
    assert (stats.rounds, stats.drafted, stats.accepted) == (5, 16, 16)  # 4 rounds of 4 + 1, then one of 0 + 1


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
@pytest.mark.parametrize("draft_name", ["snapkv@0.3", "another model"])
def test_one_step_of_accept_or_resample_is_distributed_as_the_target(llama_cm, other_draft, temperature, top_p,
                                                                    draft_name):
    """Exactly, from the real models' logits at a draft position: P(emit x) = q(x) a(x) + (1 - sum_y q(y) a(y)) r(x)
    with a = min(1, p/q) and r = norm(max(0, p - q)), the draft's and target's distributions warped as generate
    warps them."""
    target = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    draft = drafts(llama_cm, other_draft)[draft_name]
    for seed in range(4):
        ids, token = prompt(seed, 40), torch.tensor([[seed + 5]])
        for model in (target, draft):
            model.reset()
            model.prefill(ids, logits="last")
        p, q = (distribution(m.decode(token)[0, -1], temperature, top_p) for m in (target, draft))
        a = acceptance(p, q)
        emitted = q * a + (q * (1 - a)).sum() * residual(p, q)
        assert (p - q).abs().sum() > 1e-3, f"seed {seed}: the draft proposes as the target does, nothing is tested"
        assert (emitted - p).abs().max() <= 1e-6, f"seed {seed}"


def test_sampling_with_a_one_token_nucleus_is_greedy(llama_cm):
    """top_p so small that the nucleus is the argmax alone, applied to both models: every acceptance is 0 or 1 and
    every redraw the target's argmax, so sampled speculation must be the greedy output."""
    target = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    draft = kvcompile.apply(llama_cm, budget=0.3, recipe="snapkv", page_size=4)
    ids = prompt(7)
    want = target.generate(ids, max_new_tokens=20, eos_token_id=[])
    got = target.generate(ids, max_new_tokens=20, eos_token_id=[], do_sample=True, top_p=1e-6, temperature=0.8,
                          draft=draft, draft_tokens=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)
    assert 0 < target.speculation.accepted < target.speculation.drafted  # both branches of the rule were taken


def test_rewind_is_drop_from_without_compaction(llama_cm):
    """The cache's cheap rollback leaves what ``drop_from`` leaves (and zero in every row that holds no token);
    decoding after either gives the same logits."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    cm.prefill(prompt(1, 30))
    cm.decode_many(prompt(2, 7))
    a, b = cm.fork(), cm.fork()  # a fork may take back what its parent decoded
    b.cache.drop_from(a.cache.seen - 5)
    a.rewind(5)
    for layer in range(llama_cm.spec.num_layers):
        (ka, va, pa, ma), (kb, vb, pb, mb) = a.cache.dense(layer), b.cache.dense(layer)
        assert torch.equal(ma.sum(-1), mb.sum(-1)) and torch.equal(pa[ma], pb[mb]) and torch.equal(ka[ma], kb[mb])
        assert torch.equal(va[ma], vb[mb])
    for pool in (a.cache.k_pages, a.cache.v_pages):  # no row left behind: the nonzero rows are the held tokens
        assert int(pool.flatten(0, 1).ne(0).any(-1).sum()) == a.cache_stats()["tokens_held"]
    assert a.cache_stats()["bytes_held"] == b.cache_stats()["bytes_held"]
    token = torch.tensor([[9]])
    torch.testing.assert_close(a.decode(token), b.decode(token), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="appended since the last compression"):
        a.cache.rewind(a.cache.seen - 20)  # the prompt was compressed: its tokens are no tail


def test_bad_drafts_are_refused_before_anything_changes(llama_cm):
    target = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    draft = kvcompile.apply(llama_cm, budget=0.3, recipe="snapkv", page_size=4)
    target.prefill(prompt(0, 20))
    before = target.cache_stats()
    ids = prompt(1)
    bad = [
        (dict(draft=draft, draft_tokens=0), "draft_tokens must be a positive int"),
        (dict(draft=draft, draft_tokens=2.5), "draft_tokens must be a positive int"),
        (dict(draft=target), "another CompressedModel"),
        (dict(draft="snapkv"), "another CompressedModel"),
        (dict(draft=kvcompile.apply(byte_llama(), budget=0.3)), "vocabulary has 258 tokens and this model's 96"),
        (dict(draft=kvcompile.apply(llama_cm, budget=0.3, recipe="h2o-decode")), "changes its cache while decoding"),
        (dict(draft=kvcompile.apply(llama_cm, budget=0.5, recipe="kivi4")), "changes its cache while decoding"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            target.generate(ids, max_new_tokens=8, **kwargs)
    with pytest.raises(ValueError, match="one sequence at a time, got a batch of 2"):
        target.generate(torch.cat([ids, ids]), max_new_tokens=8, draft=draft)
    decoding = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv-decode")
    with pytest.raises(ValueError, match="this model's recipe 'snapkv-decode' changes its cache while decoding"):
        decoding.generate(ids, max_new_tokens=8, draft=draft)
    assert target.cache_stats() == before


def test_both_caches_end_as_a_fresh_read_of_what_was_kept(llama_cm, other_draft):
    """After rejections, each cache holds exactly the prompt and the emitted tokens it has read (rolled-back drafts
    gone): its keys and values are those of a fresh prefill of that sequence."""
    target = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    draft = kvcompile.apply(other_draft, budget=1.0, recipe="full", page_size=4)
    ids = prompt(4)
    out = target.generate(ids, max_new_tokens=20, eos_token_id=[], draft=draft, draft_tokens=3)
    assert target.speculation.accepted < target.speculation.drafted  # the rejection path ran
    for model in (target, draft):
        fresh = kvcompile.apply(model, budget=1.0, recipe="full", page_size=4)
        fresh.prefill(out[:, : int(model.seen)])
        for layer in range(model.spec.num_layers):
            (k, v, pos, valid), (k0, v0, pos0, valid0) = model.cache.dense(layer), fresh.cache.dense(layer)
            assert torch.equal(pos[valid], pos0[valid0])
            torch.testing.assert_close((k[valid], v[valid]), (k0[valid0], v0[valid0]), atol=1e-5, rtol=1e-5)


def test_rewind_is_as_if_the_tokens_were_never_read(llama_cm):
    """``rewind(n)`` (the public call speculative decoding makes): the cache and the next logits are those of a
    model that never read the last n tokens, and it is no change to tear: decoding goes on."""
    cm, fresh = (kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4) for _ in range(2))
    ids, more = prompt(1, 30), prompt(2, 7)
    for model, read in ((cm, more), (fresh, more[:, :4])):
        model.prefill(ids)
        model.decode_many(read)
    cm.rewind(0)
    cm.rewind(3)
    got, want = cm.cache_stats(), fresh.cache_stats()
    assert (got["lengths"], got["bytes_held"], cm.seen.tolist()) == (want["lengths"], want["bytes_held"],
                                                                     fresh.seen.tolist())
    token = torch.tensor([[9]])
    torch.testing.assert_close(cm.decode(token), fresh.decode(token), atol=1e-5, rtol=1e-5)


def test_bad_rewinds_are_refused_naming_the_problem_with_the_cache_unchanged(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    with pytest.raises(RuntimeError, match="prefilled cache"):
        cm.rewind(1)
    cm.prefill(prompt(1, 30))
    cm.decode_many(prompt(2, 4))
    before = cm.cache_stats()
    bad = [(-1, "n must be an int >= 0, got -1"), (1.5, "must be an int >= 0"), (True, "must be an int >= 0"),
           (5, "only tokens decoded since the last prompt or compression, 4 here, not 5")]
    for n, message in bad:
        with pytest.raises(ValueError, match=message):
            cm.rewind(n)
        assert cm.cache_stats() == before, f"rewind({n!r}) changed the cache"
    cm.prefill(prompt(3, 5))  # a new turn: its prompt is no decoded token
    with pytest.raises(ValueError, match="0 here, not 1"):
        cm.rewind(1)
    decoding = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv-decode", page_size=4)
    decoding.prefill(prompt(1, 30))
    decoding.decode(torch.tensor([[5]]))
    before = decoding.cache_stats()
    with pytest.raises(ValueError, match="recipe 'snapkv-decode' changes its cache while decoding"):
        decoding.rewind(1)
    assert decoding.cache_stats() == before
    decoding.decode(torch.tensor([[6]]))  # not torn


def test_read_prompt_reads_as_generate_does(llama_cm):
    """``read_prompt``: the context compressed before the question, the logits generate samples its first token
    from, and a refused prompt changes nothing."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    context, question = prompt(5), prompt(6, 6)
    out = cm.generate(question, context_ids=context, max_new_tokens=1, eos_token_id=[])
    want = cm.cache_stats()
    logits = cm.read_prompt(question, context_ids=context, max_new_tokens=1)
    assert logits.shape == (1, 1, VOCAB) and int(logits[0, -1].argmax()) == int(out[0, -1])
    got = cm.cache_stats()
    assert (got["lengths"], got["bytes_held"], got["query_aware"]) == (want["lengths"], want["bytes_held"], False)
    for kwargs, message in ((dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
                            (dict(context_ids=prompt(7)[:, :0]), "empty prompt: context_ids")):
        with pytest.raises(ValueError, match=message):
            cm.read_prompt(question, **kwargs)
        assert cm.cache_stats() == got
