"""Tiny random models for unit tests: one per family, built from a config, nothing downloaded."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import transformers as tf

if not torch.cuda.is_available():  # Triton kernels run through the interpreter on CPU (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the suite's own capture cache (never the user's): a tiny model's second apply loads its programs from it, so the
# whole suite also runs over programs rebuilt from the cache
os.environ.setdefault("KVCOMPILE_PROGRAM_CACHE", tempfile.mkdtemp(prefix="kvcompile-programs-"))

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512)

# (config class, extra kwargs); GQA unless the name says mha
FAMILIES = {
    "llama": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2": (tf.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (tf.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "mistral": (tf.MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "gemma3": (
        tf.Gemma3TextConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3-mha": (tf.Phi3Config, dict(num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)),
}


def fast_first(values, ids=None) -> list:
    """Parameters of which the first runs in the fast tier (``pytest -m "not slow"``) and the others only in the
    full suite: one case of an invariant checked on every change, all of them before a stop."""
    ids = ids or [None] * len(values)
    return [pytest.param(v, id=i, marks=() if n == 0 else pytest.mark.slow)
            for n, (v, i) in enumerate(zip(values, ids))]


def fresh_seed() -> int:
    """A new seed for a test on fresh random inputs, printed (pytest shows it beside a failure); ``KVC_SEED=N``
    replays that draw."""
    seed = int(os.environ.get("KVC_SEED", torch.seed() % 2**31))
    print(f"seed {seed} (replay: KVC_SEED={seed})")
    return seed


def tiny_model(family: str, seed: int = 0, layers: int = 2):
    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cls(**{**_COMMON, "num_hidden_layers": layers, **extra}, eos_token_id=VOCAB - 1, bos_token_id=1)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def byte_tokenizer():
    """A byte-level tokenizer with <s>=0, </s>=1 and one id per byte (no merges): nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return tf.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def byte_llama():
    """A 2-layer GQA llama over ``byte_tokenizer``'s vocabulary, 2048 positions."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


class TinyTokenizer:
    """Spells text for the tiny models (vocabulary ``VOCAB``) as a user's tokenizer does for theirs, one id per
    character, so ``kvcompile.recipes.anchors.resolve`` can fill a recipe's text (TaskPress's meta-query)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [2 + ord(c) % (VOCAB - 3) for c in text]


def spelled(recipe):
    """``recipe`` resolved for the tiny models' vocabulary, as a user resolves it for their tokenizer."""
    from kvcompile.recipes import anchors

    return anchors.resolve(recipe, TinyTokenizer())


def stored_rows(db) -> dict:
    """A results store's rows by key, wall and write time left out (they differ between equal runs); fails if a
    row is stored twice."""
    from kvcompile.eval.store import KEY, Store

    with Store(db) as store:
        rows = store.rows()
    by_key = {tuple(r[k] for k in KEY): r for r in rows}
    assert len(by_key) == len(rows), "a row stored twice"
    return {k: {c: v for c, v in r.items() if c not in ("wall_s", "created")} for k, r in by_key.items()}


def left_padded_batch(lengths, total: int, seed: int = 0):
    """input_ids, attention_mask [len(lengths), total] with row i holding lengths[i] real tokens at the right."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB - 1, (len(lengths), total), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n :] = 1
    return ids.masked_fill(mask == 0, 0), mask



def eager_attentions(model, ids):
    """The plain transformers ``model``'s attention weights over ``ids`` [B, T]: L x [B, Hq, T, T] (eager attention
    for this one call)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")

def assert_plain_at_full_budget(model, captured, recipe) -> None:
    """``recipe`` at budget 1.0 reproduces ``model`` (the plain transformers model ``captured`` was applied to)."""
    import kvcompile

    cm = kvcompile.apply(captured, budget=1.0, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([40, 31], total=40, seed=2)
    logits = cm.prefill(ids, mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0)).logits
    assert (logits[mask.bool()] - ref[mask.bool()]).abs().max() <= 1e-4


def run_analysis(model, argv: list[str]) -> int:
    """``kvcompile analyze <argv>`` as the CLI parses it, run on ``model`` with the byte tokenizer (no model load)."""
    import argparse

    from kvcompile.eval.analysis import commands

    parser = argparse.ArgumentParser()
    commands.add_parsers(parser.add_subparsers(dest="analysis"))
    args = parser.parse_args(argv)
    args.argv = ["analyze", *argv]
    return commands.run(args, lambda name: (model, byte_tokenizer()))


def assert_decode_agrees(compiled, eager, a, b, steps: int) -> None:
    """Greedy ``steps`` from the prefill logits ``a`` (compiled) and ``b`` (eager): every step's logits agree."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for step in range(steps):
        token = b[:, -1].argmax(-1, keepdim=True)
        a, b = compiled.decode(token), eager.decode(token)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"decode step {step}: {m}")


def assert_head_attends(out, q, q_pos, h: int, G: int, keys, values, pos, window: int, tol: float) -> None:
    """Query heads ``h*G .. h*G+G-1`` of ``out`` [1, Hq, T, D] equal plain softmax attention (scale 0.3) over one KV
    head's dense ``keys``/``values`` at positions ``pos``, causal by position and within ``window`` (0: none).

    ``tol`` plus fp32's own error bound: a logit summed in another order moves by up to D eps sum_i |q_i k_i| x scale,
    and the output by twice that times the largest value (keys with outlier channels make logits of thousands)."""
    for t in range(q.shape[2]):
        seen = (pos <= q_pos[0, t]) & ((q_pos[0, t] - pos < window) if window else True)
        for i in range(G):
            query = q[0, h * G + i, t]
            scores = (query @ keys.T * 0.3).masked_fill(~seen, float("-inf"))
            expect = torch.softmax(scores, -1).nan_to_num(0.0) @ values
            rounding = 0.0
            if keys.numel():
                terms = float((query.abs() @ keys.abs().float().T * 0.3).max())
                rounding = 2 * q.shape[-1] * torch.finfo(torch.float32).eps * terms * float(values.abs().max())
            torch.testing.assert_close(out[0, h * G + i, t], expect, atol=tol + rounding, rtol=tol)


TINY_SCHEDULE = dict(steps=60, batch=64, lr=5e-3, seed=3, checkpoint_every=20)
TINY_DATA = dict(lengths=(256,), per_length=3, held_out=1, per_context=64, progress=False)


def train_tiny(method: str, model, tokenizer, out, schedule: dict | None = None, **data):
    """``kvcompile.train.train`` of a learned scorer on a tiny model, short (``TINY_SCHEDULE``, ``TINY_DATA``, with
    ``schedule`` and ``data`` changes): (its weights' path, its card)."""
    from kvcompile.train import train
    from kvcompile.train.loop import Schedule

    card = train(method, model, tokenizer, name="tiny", schedule=Schedule(**TINY_SCHEDULE | (schedule or {})), out=out,
                 **TINY_DATA | data)
    return out / f"{method}-tiny.safetensors", card


@pytest.fixture(scope="session")
def tiny_lm():
    """(``byte_llama()``, ``byte_tokenizer()``): what the learned scorers' tests train on."""
    return byte_llama(), byte_tokenizer()


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama", layers=3)


@pytest.fixture(scope="session")
def llama_cm(llama):
    """The 3-layer llama captured once; tests derive recipes and budgets with ``kvcompile.apply(llama_cm, ...)``."""
    import kvcompile

    return kvcompile.apply(llama, budget=1.0, recipe="full")


def merged_and_repeated(B: int = 2, Hkv: int = 2, D: int = 16, P: int = 4, seed: int = 0, device="cpu"):
    """The same heads twice, as the kernels take them: ``merged``, whose entries stand for n = 1..4 tokens each
    (log-weight log n), and ``repeated``, where each entry is n plain tokens with its key, value and position.
    Each is (k_pages, v_pages, page_pos, page_lw, page_table, lengths) on shuffled pages; ``repeated``'s page_lw is
    empty ([0, P]: no weight channel). Positions are ascending, some shared, within 0..39."""
    g = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(B * Hkv):
        S = int(torch.randint(1, 12, (), generator=g))
        n = torch.randint(1, 5, (S,), generator=g)
        heads.append((torch.randn(S, D, generator=g), torch.randn(S, D, generator=g),
                      torch.randint(0, 40, (S,), generator=g).sort().values, n))

    def paged(rows, weighted: bool):
        width = max(-(-max(len(r[2]) for r in rows) // P), 2)
        N = 1 + len(rows) * width
        table = (torch.randperm(N - 1, generator=g) + 1).view(B, Hkv, width).int()
        k_pages, v_pages, page_lw = torch.zeros(N, P, D), torch.zeros(N, P, D), torch.zeros(N if weighted else 0, P)
        page_pos = torch.zeros(N, P, dtype=torch.int32)
        for i, (k, v, pos, lw) in enumerate(rows):
            j = torch.arange(len(pos))
            at = (table.view(-1, width)[i][j // P].long(), j % P)
            k_pages[at], v_pages[at], page_pos[at] = k, v, pos.int()
            if weighted:
                page_lw[at] = lw
        lengths = torch.tensor([len(r[2]) for r in rows], dtype=torch.int32).view(B, Hkv)
        return tuple(t.to(device) for t in (k_pages, v_pages, page_pos, page_lw, table, lengths))

    merged = paged([(k, v, pos, n.float().log()) for k, v, pos, n in heads], weighted=True)
    repeated = paged([(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0), pos.repeat_interleave(n), None)
                      for k, v, pos, n in heads], weighted=False)
    return merged, repeated


@pytest.fixture(scope="session")
def byte_full():
    """``byte_llama`` captured once (full budget, pages of 4): the analyses' tests derive every cell from it."""
    import kvcompile

    return kvcompile.apply(byte_llama(), budget=1.0, recipe="full", page_size=4)
