"""A plain nn.Module that calls F.scaled_dot_product_attention itself is rewritten like a transformers model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvcompile
from kvcompile.passes import UnsupportedGraph


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv, causal=True):
        super().__init__()
        self.h, self.kv, self.d, self.causal = n_heads, n_kv, dim // n_heads, causal
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv) * self.d)
        self.out = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.h * self.d, self.kv * self.d, self.kv * self.d], -1)
        q = q.view(B, T, self.h, self.d).transpose(1, 2)
        k = k.view(B, T, self.kv, self.d).transpose(1, 2)
        v = v.view(B, T, self.kv, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv != self.h)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """GPT with learned absolute positions: forward(input_ids, position_ids) -> logits."""

    def __init__(self, vocab=64, dim=32, n_heads=4, n_kv=2, layers=2, max_positions=128, causal=True):
        super().__init__()
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = layers, n_heads, n_kv, dim // n_heads
        self.max_positions = max_positions
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv, causal) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):
        x = self.tok(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_gpt_full_budget_matches_eager():
    torch.manual_seed(0)
    gpt = TinyGPT().eval()
    cm = kvcompile.apply(gpt, budget=1.0, recipe="full", page_size=4)
    ids = torch.randint(0, 64, (3, 9))
    with torch.no_grad():
        logits = cm.prefill(ids)
        assert (logits - gpt(ids, torch.arange(9).expand(3, 9))).abs().max() <= 1e-4
        for step in range(32):
            token = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], 1)
            logits = cm.decode(token)
            ref = gpt(ids, torch.arange(ids.shape[1]).expand_as(ids))[:, -1:]
            assert (logits - ref).abs().max() <= 1e-4, f"decode step {step}"


def test_rewrites_one_op_per_layer():
    cm = kvcompile.apply(TinyGPT(layers=3).eval(), budget=0.5, recipe="snapkv")
    ops = [n for n in cm.programs.decode.graph.nodes if n.target is torch.ops.kvcompile.decode_attention.default]
    assert [n.kwargs["layer"] for n in ops] == [0, 1, 2]
    assert not any("scaled_dot_product" in str(n.target) for n in cm.programs.prefill.graph.nodes)


def test_non_causal_attention_is_refused_with_the_node_named():
    with pytest.raises(UnsupportedGraph, match=r"blocks\.0.*is_causal"):
        kvcompile.apply(TinyGPT(causal=False).eval(), budget=0.5)


def test_module_without_attention_is_refused():
    class NoAttention(nn.Module):
        num_layers, num_heads, num_kv_heads, head_dim = 1, 1, 1, 4

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)

        def forward(self, input_ids, position_ids):
            return self.emb(input_ids)

    with pytest.raises(UnsupportedGraph, match="no scaled_dot_product_attention"):
        kvcompile.apply(NoAttention(), budget=0.5)
