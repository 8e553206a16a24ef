"""Transactional Attention's TA-Fast (docs/methods_scorers.md#ta-fast, inferred): anchors sponsor the value after them
out of a share of the budget; against plain-Python references of the span rule and of the share, then end to end on a
byte-level model, where each character is one token."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_plain_at_full_budget, byte_llama, byte_tokenizer, left_padded_batch

import kvcompile
from kvcompile.methods.transactional import find_anchors, spans, sponsor_first
from kvcompile.recipes import anchors, compose

FILLER = "The grass is green. The sky is blue. Here we go. "


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def byte_cm():
    return kvcompile.apply(byte_llama(), budget=1.0, recipe="full", page_size=4)


def held(cm, layer: int, head: int) -> set[int]:
    """Positions one head of row 0 holds."""
    _, _, pos, valid = cm.cache.dense(layer)
    return set(pos[0, head][valid[0, head]].tolist())


def every_head(cm) -> list[set[int]]:
    return [held(cm, layer, h) for layer in range(cm.spec.num_layers) for h in range(cm.spec.num_kv_heads)]


def context(tok, lines: list[str]) -> tuple[torch.Tensor, str]:
    text = FILLER * 6 + "\n".join(lines) + "\n" + FILLER * 6
    return torch.tensor([tok.encode(text, add_special_tokens=False)]), text


def span_of(text: str, value: str) -> set[int]:
    start = text.index(value)
    return set(range(start, start + len(value)))


def reference_spans(ids: list[int], anchor_seqs: list[list[int]], delimiters: set[int], span: int) -> list[bool]:
    out, start = [False] * len(ids), None
    for p in range(len(ids)):
        if any(p >= len(a) and ids[p - len(a):p] == a for a in anchor_seqs):
            start = p
        if start is not None and ids[p] in delimiters:
            start = None
        out[p] = start is not None and p - start < span
    return out


def test_sponsored_spans_follow_the_anchor_rule():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(20):
        ids = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 3))] for _ in range(rng.randrange(1, 3))]
        delimiters, span = {rng.randrange(6)}, rng.randrange(1, 6)
        t = torch.tensor([ids])
        got = spans(find_anchors(t, seqs)[0], torch.isin(t, torch.tensor(sorted(delimiters))), span)[0].tolist()
        assert got == reference_spans(ids, seqs, delimiters, span), f"seed {seed}: {ids} {seqs} {delimiters} {span}"


def test_any_budget_keeps_the_first_sponsored_within_the_share_and_the_base_top_beside_them():
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    for share in (0.25, 0.5):
        base = torch.rand(1, 1, 64, generator=gen)
        sponsored = torch.rand(1, 1, 64, generator=gen) < 0.3
        order = (-sponsor_first(base, sponsored, torch.arange(64).view(1, 1, 64), share)).flatten().argsort(stable=True)
        spons = sponsored.flatten().nonzero().flatten().tolist()
        by_base = base.flatten().argsort(descending=True).tolist()
        for k in range(1, 65):
            top = set(order[:k].tolist())
            assert set(spons[: min(int(share * k), len(spons))]) <= top, f"seed {seed}: k={k}"
            assert set(by_base[: int((1 - share) * k)]) <= top, f"seed {seed}: k={k}"
            assert len(top - set(by_base[:k])) <= -(-share * k // 1), f"seed {seed}: k={k}: sponsorship over its share"


def test_a_credential_after_an_anchor_survives_16_tokens_where_snapkv_drops_it(tok, byte_cm):
    ids, text = context(tok, ["note: nothing here", "login admin password: 7Q9"])
    value = span_of(text, " 7Q9")
    ta = kvcompile.apply(byte_cm, budget=16, recipe=anchors.resolve("ta-fast+snapkv", tok))
    snap = kvcompile.apply(byte_cm, budget=16, recipe="snapkv")
    ta.prefill(ids), snap.prefill(ids)
    assert all(value <= h for h in every_head(ta)), "TA keeps the sponsored value in every head"
    assert all(not (value & h) for h in every_head(snap)), "SnapKV alone keeps none of it"
    stats = ta.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]


def test_injected_anchors_exhaust_only_the_share_and_an_allow_list_restores_the_credential(tok, byte_cm):
    fakes = [f"key: {c}{c}{c}" for c in "ABCDEFGHIJ"]
    ids, text = context(tok, fakes + ["login admin password: 7Q9"])
    value = span_of(text, " 7Q9")
    fake_values = set().union(*(span_of(text, f" {c}{c}{c}") for c in "ABCDEFGHIJ"))
    flooded = kvcompile.apply(byte_cm, budget=16, recipe=anchors.resolve("ta-fast+snapkv", tok))
    base_share = kvcompile.apply(byte_cm, budget=12, recipe="snapkv")  # what (1 - 0.25) of the budget keeps alone
    allowed = kvcompile.apply(byte_cm, budget=16,
                              recipe=anchors.resolve("ta-fast+snapkv", tok, patterns=["password:"]))
    for cm in (flooded, base_share, allowed):
        cm.prefill(ids)
    for h_flooded, h_base, h_allowed in zip(every_head(flooded), every_head(base_share), every_head(allowed)):
        assert not (value & h_flooded) and len(h_flooded & fake_values) == 4, "the fakes took the share, only it"
        assert h_base <= h_flooded, "the rest of the budget is the base's, untouched"
        assert value <= h_allowed and not (h_allowed & fake_values), "allow-listed: the credential is back"


def test_budget_is_held_in_a_padded_batch(tok, byte_cm):
    ids, mask = left_padded_batch([90, 64], total=90, seed=3)
    cm = kvcompile.apply(byte_cm, budget=0.25, recipe=anchors.resolve("ta-fast+snapkv", tok))
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["bytes"]["tables"] >= ids.numel() * 8, "the token log is reported"


def test_full_budget_reproduces_the_model(llama, llama_cm):
    assert_plain_at_full_budget(llama, llama_cm, compose("ta-fast", "snapkv", anchors=[[5, 6], [7]], delimiters=[9]))


def test_unresolved_or_bad_anchors_are_refused_before_anything_runs(llama_cm):
    with pytest.raises(ValueError, match=r"anchors.resolve\(recipe, tokenizer\)"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="ta-fast+snapkv")
    with pytest.raises(ValueError, match="non-empty sequence of token ids"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=compose("ta-fast", "snapkv", anchors=[[]]))
    with pytest.raises(ValueError, match="0 < share < 1"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=compose("ta-fast", "snapkv", anchors=[[5]], share=1.0))
    with pytest.raises(ValueError, match="non-empty list of non-blank strings"):
        anchors.resolve("ta-fast+snapkv", byte_tokenizer(), patterns="password:")


def test_a_sweep_resolves_the_anchors_and_shares_one_prefill_that_logs_the_ids(tok, byte_cm):
    from kvcompile.eval import sweep

    out = sweep.run(byte_cm, tok, ["ta-fast+snapkv", "snapkv"], [16], ["credential"], n_samples=1, length=256,
                    progress=False)
    rows = {r["recipe"]: r for r in out["rows"]}
    assert set(rows) == {"full", "ta-fast+snapkv", "snapkv"} and not any(r["error"] for r in rows.values())
    assert rows["ta-fast+snapkv"]["bytes_held_mean"] <= rows["snapkv"]["bytes_held_mean"]


def test_anchor_link_is_each_querys_attention_on_the_anchor_before_its_value():
    from test_scorers import make_obs

    from kvcompile.methods.transactional import anchor_link

    seed = random.randrange(1 << 30)
    obs = make_obs(S=20, W=20, seed=seed)
    starts, tokens = torch.zeros(1, 20, dtype=torch.bool), torch.zeros(1, 20, dtype=torch.bool)
    starts[0, [5, 12]], tokens[0, [3, 4, 11]] = True, True  # anchors at 3-4 and 11, values from 5 and 12
    got = anchor_link(obs, starts, tokens, longest=2)[0]
    for p in range(20):
        start = max((s for s in (5, 12) if s <= p), default=None)
        want = 0.0
        if start is not None:
            anchor = [k for k in (3, 4, 11) if start - 2 <= k < start]
            for h in range(4):
                attn = torch.softmax(obs.keys[0, h // 2, : p + 1] @ obs.queries[0, h, p] * obs.scale, 0)
                want += float(attn[anchor].sum()) / 4
        assert abs(float(got[p]) - want) < 1e-5, f"seed {seed}: position {p}"


def test_ta_sponsors_the_whole_span_at_link_0_and_nothing_above_every_link(tok, byte_cm):
    ids, _ = context(tok, ["login admin password: 7Q9"])
    anchor_ids = anchors.anchor_ids(tok)
    cells = {"ta0": compose("ta", "snapkv", anchors=anchor_ids, link=0.0),
             "fast": compose("ta-fast", "snapkv", anchors=anchor_ids, delimiters=[]),
             "ta1": compose("ta", "snapkv", anchors=anchor_ids, link=1.0), "snapkv": "snapkv"}
    held_by = {}
    for name, recipe in cells.items():
        cm = kvcompile.apply(byte_cm, budget=16, recipe=recipe)
        cm.prefill(ids)
        held_by[name] = every_head(cm)
        assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"], name
    assert held_by["ta0"] == held_by["fast"], "link 0: every token of the span is linked"
    assert held_by["ta1"] == held_by["snapkv"], "no query pays the anchor all its attention: nothing sponsored"
    assert held_by["ta0"] != held_by["snapkv"]
    assert_plain_at_full_budget(byte_cm.source, byte_cm, compose("ta", "snapkv", anchors=anchor_ids))
    with pytest.raises(ValueError, match="0 <= link <= 1"):
        kvcompile.apply(byte_cm, budget=16, recipe=compose("ta", "snapkv", anchors=anchor_ids, link=2.0))
