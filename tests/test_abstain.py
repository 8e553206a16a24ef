"""Compression-aware abstention (``train.abstain``): the survival rule, labels that are a deterministic function of
(compressor, budget, rule) and all Confident at budget 1.0, targets (the gold answer or the refusal), and a short
training run whose card reports the served outcomes with and without the adapter."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_llama, byte_tokenizer

from kvcompile.eval.decoding import encode
from kvcompile.train.abstain import REFUSAL, examples, finetune, survived
from kvcompile.train.loop import Schedule


def test_the_span_survives_when_each_token_is_kept_by_enough_heads():
    keep = torch.ones(2, 2, 10, dtype=torch.bool)
    keep[0, :, 3] = False  # position 3: kept by 2 of 4 (layer, head) pairs
    keep[:, 0, 5] = False
    keep[1, 1, 5] = False  # position 5: kept by 1 of 4
    assert survived(keep, [2, 3], rule=0.5) and not survived(keep, [3, 5], rule=0.5)
    assert not survived(keep, [3], rule=0.75)
    assert survived(keep, [3, 5], rule=0.25)
    with pytest.raises(ValueError, match="no evidence positions"):
        survived(keep, [])


@pytest.fixture(scope="module")
def tiny():
    return byte_llama(), byte_tokenizer()


def test_labels_are_deterministic_and_all_confident_at_full_budget(tiny):
    model, tok = tiny
    full = examples(model, tok, 4, 1024, seed=0, progress=False, compressors=(("snapkv", 1.0),))
    assert all(e["survived"] for e in full)
    for e in full:
        assert e["ids"][0, e["start"]:].tolist() == encode(tok, " " + e["sample"].answer) + [tok.eos_token_id]
    tight = [examples(model, tok, 6, 1024, seed=0, progress=False, compressors=(("streamingllm", 0.05),))
             for _ in range(2)]
    assert [e["survived"] for e in tight[0]] == [e["survived"] for e in tight[1]]
    lost = [e for e in tight[0] if not e["survived"]]
    assert lost, "a 5% StreamingLLM window keeps no needle in the middle of 1,000 bytes"
    assert lost[0]["ids"][0, lost[0]["start"]:].tolist() == encode(tok, " " + REFUSAL) + [tok.eos_token_id]


@pytest.mark.slow
def test_a_short_run_trains_and_reports_served_outcomes(tiny, tmp_path):
    model, tok = tiny
    card = finetune(model, tok, name="tiny", schedule=Schedule(steps=6, batch=2, lr=1e-3, seed=0, checkpoint_every=3),
                    rank=2, length=1024, n=8, held_out=4, out=tmp_path, progress=False)
    assert card["method"] == "abstain" and card["final_loss"] < card["initial_loss"]
    assert (tmp_path / "abstain-tiny.safetensors").is_file()
    for side in ("adapter", "no_adapter"):
        rates = card["held_out"][side]
        assert rates["all"]["n"] == 4 == rates["evidence kept"]["n"] + rates["evidence lost"]["n"]
        assert sum(rates["all"][k] for k in ("correct", "hallucinated", "abstained")) == pytest.approx(1.0)


@pytest.mark.slow
def test_the_shipped_adapter_runs_by_name_on_smollm2_and_hallucinates_less():
    import kvcompile
    from kvcompile.eval.decoding import ids_tensor
    from kvcompile.methods import learned

    adapter = kvcompile.recipes()["abstain-kvzip"].adapter
    _, card = learned.load(adapter["method"], adapter["weights"], adapter["sha256"])
    held = card["held_out"]
    assert held["adapter"]["all"]["hallucinated"] < held["no_adapter"]["all"]["hallucinated"]
    assert held["adapter"]["evidence lost"]["abstained"] > held["adapter"]["evidence kept"]["abstained"]
    model, tok = kvcompile.load_model("smollm2-135m")
    sample = examples(model, tok, 1, 512, seed=5, progress=False)[0]
    cm = kvcompile.apply(model, budget=0.25, recipe="abstain-kvzip")
    cm.prefill(ids_tensor(sample["context"], cm.device))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == "abstain-kvzip@1"


def test_the_random_mask_control_keeps_as_many_tokens_per_head(tiny):
    model, tok = tiny
    real, control = (examples(model, tok, 4, 1024, seed=0, progress=False, compressors=(("snapkv", 0.2),),
                              control=c) for c in (False, True))
    for a, b in zip(real, control):
        assert torch.equal(a["keep"].sum(-1), b["keep"].sum(-1)) and not torch.equal(a["keep"], b["keep"])
        assert b["evidence"] == a["evidence"]  # the same sample
        assert b["survived"] == survived(b["keep"], b["evidence"])  # the label follows the random set
