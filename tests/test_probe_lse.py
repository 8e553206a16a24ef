"""KVzip's probe maximum from the log-sum-exp the reconstruction's attention records (``Observation.query_lse``):
the same scores as the softmax it replaces, for KVzip, KVCompose's maximum and the probes weighted per query
(KVzip+), and the same kept entries through the public API as a batch whose padding leaves the log-sum-exp
unrecorded."""

from __future__ import annotations

import torch
from conftest import VOCAB, fresh_seed

import kvcompile
from kvcompile.methods import Observation
from kvcompile.methods.kvcompose import KVCompose
from kvcompile.methods.kvzip import KVzip
from kvcompile.methods.kvzip_plus import KVzipPlus


def reconstruction(seed: int, B=2, Hkv=2, G=3, n=11, W=7, D=8):
    """An observation after a reconstruction prompt: n context entries, then the W probes' own entries, the ring
    holding the probes; and the log-sum-exp of each probe's causal attention, from its definition."""
    g = torch.Generator().manual_seed(seed)
    S = n + W
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    queries = torch.randn(B, Hkv * G, W, D, generator=g)
    positions = torch.arange(S).expand(B, Hkv, S)
    q_pos = torch.arange(n, S).expand(B, W)
    logits = queries.view(B, Hkv, G * W, D) @ keys.transpose(-1, -2) * D**-0.5  # [B, Hkv, G * W, S]
    seen = positions[:, :, None, :] <= q_pos.repeat(1, G)[:, None, :, None]
    lse = logits.masked_fill(~seen, float("-inf")).logsumexp(-1).view(B, Hkv * G, W)
    args = (keys, values, positions, torch.ones(B, Hkv, S, dtype=torch.bool), queries, q_pos, D**-0.5, 0, 0, 1)
    return args, lse, n


def test_the_probe_maximum_from_the_recorded_lse_is_the_softmax_one():
    args, lse, n = reconstruction(fresh_seed())
    norms = torch.rand(lse.shape[0], lse.shape[2]) * 3 + 0.1
    w_o = torch.randn(16, lse.shape[1] * args[0].shape[-1])
    for scorer, extra in ((KVzip(n_sink=0), {}), (KVCompose(), {}),
                          (KVzipPlus(n_sink=0), {"weights": {"o_proj": w_o}, "query_input_norms": norms})):
        softmax = scorer.score(Observation(*args, **extra))
        recorded = scorer.score(Observation(*args, **extra, query_lse=lse))
        assert torch.isinf(recorded[..., n:]).all() and torch.isinf(softmax[..., n:]).all(), "probes are never kept"
        torch.testing.assert_close(recorded[..., :n], softmax[..., :n], rtol=1e-5, atol=1e-7)
        unknown = lse.clone()
        unknown[0, 0, 3] = float("nan")  # one probe's attention recorded nothing: the softmax serves
        assert torch.equal(scorer.score(Observation(*args, **extra, query_lse=unknown)), softmax)


def test_kvzip_keeps_what_it_keeps_in_a_padded_batch(llama_cm):
    """A row read alone (its reconstruction's attention records the log-sum-exp) keeps the entries it keeps beside
    a longer row, left-padded (padding leaves it unrecorded: the softmax serves)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB - 1, (1, 150), generator=g)
    alone = kvcompile.apply(llama_cm, budget=0.3, recipe="kvzip")
    alone.prefill(ids)
    padded = kvcompile.apply(llama_cm, budget=0.3, recipe="kvzip")
    longer = torch.randint(2, VOCAB - 1, (1, 190), generator=g)
    batch = torch.cat([torch.nn.functional.pad(ids, (40, 0)), longer])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(ids), (40, 0)), torch.ones_like(longer)])
    padded.prefill(batch, attention_mask=mask)
    one, two = alone.held_positions()[:, 0], padded.held_positions()[:, 0]
    assert torch.equal(one.sort(-1).values, two[..., : one.shape[-1]].sort(-1).values), f"seed={seed}"
