"""A fraction budget has one definition (docs/guide.md, "budget"): that share of the KV bytes of the tokens it is
measured against, ``cache_stats()["budgeted_tokens"]`` per row: the context compressed (with the question, for a
recipe that reads it), or, once a decode-time cap runs, every token read. Checked as a property while generating,
over recipes of both kinds, batches, lengths, page sizes and fractions."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompile

DECODE_TIME = ("inertiakv-lazy", "growpage", "cam", "h2o-decode")
PREFILL_TIME = ("snapkv", "finch")  # finch reads the question and compresses it with the context


@pytest.fixture(scope="module")
def base():
    return kvcompile.apply(tiny_model("gemma3", seed=5), budget=1.0, recipe="full")


def left_padded(lengths: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(lengths)
    ids = torch.randint(2, VOCAB - 1, (len(lengths), T), generator=g)
    return ids, torch.stack([torch.arange(T) >= T - n for n in lengths]).long()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recipe=st.sampled_from(DECODE_TIME + PREFILL_TIME), fraction=st.floats(0.2, 0.9),
       context=st.lists(st.integers(12, 60), min_size=1, max_size=3), question=st.integers(2, 9),
       new=st.integers(1, 24), page_size=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**31 - 1))
def test_a_fraction_is_a_share_of_the_budgeted_tokens(base, recipe, fraction, context, question, new, page_size,
                                                      seed):
    g = torch.Generator().manual_seed(seed)
    ctx, ctx_mask = left_padded(context, g)
    q = torch.randint(2, VOCAB - 1, (len(context), question), generator=g)
    cm = kvcompile.apply(base, budget=fraction, recipe=recipe, page_size=page_size)
    cm.generate(q, context_ids=ctx, context_mask=ctx_mask, max_new_tokens=new, eos_token_id=[])
    stats, n = cm.cache_stats(), torch.tensor(context)
    if recipe in DECODE_TIME and new > 1:  # the cap runs from the first decode step: every token read
        want = n + question + new - 1  # the last token generated is not read yet
    else:
        want = n + (question if recipe == "finch" else 0)
    assert stats["budgeted_tokens"] == want.tolist(), f"{recipe}: measured against {stats['budgeted_tokens']}"
    spec = cm.spec
    per_token = spec.num_layers * spec.num_kv_heads * cm.cache.token_bytes
    assert stats["budget_bytes"] == sum(int(fraction * t * per_token) for t in want.tolist())
