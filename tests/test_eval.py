"""Evaluation: the lm-eval model really scores through the compressed cache, the suite is deterministic, fidelity
metrics are zero at full budget, and a shared-prefill sweep cell equals a separately run one."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_llama, byte_tokenizer
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

import kvcompile
from kvcompile.eval import fidelity, sweep
from kvcompile.eval.harness import KVCompileLM
from kvcompile.eval.synthetic import SEPARATOR, TASKS, make_sample


@pytest.fixture(scope="module")
def tiny():
    """(hf model, tokenizer, CompressedModel at full budget): a 2-layer GQA llama over the byte vocabulary."""
    model = byte_llama()
    return model, byte_tokenizer(), kvcompile.apply(model, budget=1.0, recipe="full")


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _mc_task():
    """Three multiple-choice questions over long-ish contexts, three choices each: (context, continuation) pairs."""
    text = "The kettle sat on the stove while rain ran down the window and the cat slept by the door. " * 3
    out = []
    for q, choices in [("Where did the kettle sit?", [" on the stove", " in the garden", " under a bridge"]),
                       ("What ran down the window?", [" rain", " paint", " a spider"]),
                       ("Where did the cat sleep?", [" by the door", " on the roof", " in a box"])]:
        out += [(f"{text}\nQuestion: {q}\nAnswer:", c) for c in choices]
    return out


def test_loglikelihood_matches_hflm_at_full_budget_and_changes_when_compressed(tiny):
    model, tok, cm = tiny
    pairs = _mc_task()
    stock = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=2048)
    ref = [ll for ll, _ in stock.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)]
    ours = KVCompileLM(cm, tokenizer=tok)
    full = [ll for ll, _ in ours.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)]
    assert max(abs(a - b) for a, b in zip(ref, full)) < 1e-4
    low = KVCompileLM(cm, tokenizer=tok, recipe="snapkv", budget=0.25)
    comp = [ll for ll, _ in low.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)]
    assert max(abs(a - b) for a, b in zip(ref, comp)) > 1e-2, "compression is not in the loglikelihood path"
    info = low.get_model_info()["kvcompile"]
    assert info["recipe"].startswith("snapkv") and info["requests"] == 3  # one compressed prefill per shared context
    assert info["bytes_held_max"] < 0.5 * info["bytes_full_mean"] and info["query_aware"]


def test_rolling_loglikelihood_streams_with_eviction(tiny):
    model, tok, cm = tiny
    text = [("A river of words flows past the mill, turning its wheel slowly through the long afternoon. " * 4,)]
    stock = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=2048)
    ref = stock.loglikelihood_rolling(_requests("loglikelihood_rolling", text), disable_tqdm=True)[0]
    full = KVCompileLM(cm, tokenizer=tok, rolling_chunk=64)
    assert abs(full.loglikelihood_rolling(_requests("loglikelihood_rolling", text), disable_tqdm=True)[0] - ref) < 1e-3
    low = KVCompileLM(cm, tokenizer=tok, recipe="streamingllm", budget=0.25, rolling_chunk=64)
    streamed = low.loglikelihood_rolling(_requests("loglikelihood_rolling", text), disable_tqdm=True)[0]
    assert abs(streamed - ref) > 1e-2
    assert low.requests[0]["bytes_held"] < 0.5 * low.requests[0]["bytes_full"]


def test_generate_until_compresses_before_the_question(tiny):
    model, tok, cm = tiny
    context, question = "Some context that will be compressed. " * 6, "\nWhat was it?"
    gen = {"until": [], "max_gen_toks": 6, "do_sample": False}
    lm = KVCompileLM(cm, tokenizer=tok)
    split, whole = lm.generate_until(_requests("generate_until", [(context + SEPARATOR + question, gen),
                                                                  (context + question, gen)]), disable_tqdm=True)
    ids = tok(context + question, return_tensors="pt")["input_ids"]
    expected = tok.decode(cm.generate(ids, max_new_tokens=6, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:],
                          skip_special_tokens=True)
    assert split == whole == expected  # at full budget the split changes nothing
    assert [r["query_aware"] for r in lm.requests] == [False, True]


def test_suite_is_deterministic_and_fits_the_length():
    tok = byte_tokenizer()
    for name, task in TASKS.items():
        a, b = (make_sample(name, tok, 2048, seed=1, index=2) for _ in range(2))
        assert a == b, name
        assert make_sample(name, tok, 2048, seed=2, index=2) != a, name
        n = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in a.prompt(tok))
        assert 0.7 * 2048 <= n + task.max_new_tokens <= 2048, (name, n)
        assert all(ans in a.context for ans in a.answers) or name in ("vt", "fwe"), name


def test_fidelity_is_exact_at_full_budget_and_oracle_beats_random(tiny):
    _, tok, cm = tiny
    rows = fidelity.measure(cm, tok, ["full", "random"], [1.0, 0.25][:1], context=96, scored=32, windows=1,
                            greedy_tokens=8, oracle=False, progress=False)
    full = rows[0]
    assert full["kl_max"] < 1e-6 and full["top1"] == 1.0 and full["greedy_agree"] == 1.0
    assert full["dropped_mass"] == 0.0 and full["attn_rel_err"] < 1e-6
    rows = fidelity.measure(cm, tok, ["random"], [0.25], context=96, scored=32, windows=1, greedy_tokens=0,
                            progress=False)
    rand, oracle = rows
    assert oracle["recipe"] == "oracle@1" and rand["kl_mean"] > 1e-4
    assert 0 < oracle["dropped_mass"] < rand["dropped_mass"]


def test_fork_then_compress_equals_a_separate_run(tiny):
    _, tok, cm = tiny
    ids = torch.randint(2, 258, (1, 120), generator=torch.Generator().manual_seed(0))
    base = kvcompile.apply(cm, budget=1.0, recipe="snapkv")
    base.prefill(ids, compress=False, logits="last")
    for recipe in ("snapkv", "knorm", "streamingllm"):
        fork = base.fork(recipe, 0.25)
        fork.compress()
        alone = kvcompile.apply(cm, budget=0.25, recipe=recipe)
        alone.prefill(ids, logits="last")
        assert torch.equal(fork.cache.lengths, alone.cache.lengths), recipe
        for layer in range(cm.spec.num_layers):
            assert torch.equal(fork.cache.dense(layer)[2], alone.cache.dense(layer)[2]), (recipe, layer)
        q = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(fork.prefill(q, compress=False), alone.prefill(q, compress=False))
    assert int(base.cache.lengths.min()) == 120  # the source cache is untouched


def test_sweep_shared_prefill_equals_separate_cells(tiny, tmp_path):
    _, tok, cm = tiny
    broken = kvcompile.Recipe("broken", "oracle")  # an oracle without scores raises (fidelity registered it)
    result = sweep.run(cm, tok, ["snapkv", "streamingllm", broken], [0.5, 0.25], ["passkey"], n_samples=1,
                       length=512, kl=True, measure_separate=1, progress=False)
    t = result["timing"]
    assert t["separate_contexts"] == 1 and t["separate_mismatches"] == 0
    rows = {(r["recipe"], r["budget"]): r for r in result["rows"]}
    assert rows[("full", "1")]["kl_mean"] < 1e-6 and rows[("full", "1")]["top1"] == 1.0
    assert rows[("snapkv", "0.25")]["bytes_held_mean"] < rows[("snapkv", "0.5")]["bytes_held_mean"]
    assert rows[("snapkv", "0.25")]["error"] is None and rows[("snapkv", "0.25")]["n"] == 1
    assert "no scores" in rows[("broken", "0.25")]["error"] and rows[("broken", "0.25")]["n"] == 0
    paths = sweep.write(result, tmp_path / "sweep", model="tiny")
    assert {p.suffix for p in paths} >= {".csv", ".json", ".md"} and "answers that differ: 0" in paths[2].read_text()


def test_a_sweep_of_chosen_cells_runs_those_and_the_reference_alone(tiny):
    _, tok, cm = tiny
    cells = [("snapkv", 0.5), ("knorm", 0.25)]
    result = sweep.run(cm, tok, cells, None, ["passkey"], n_samples=1, length=512, progress=False)
    assert [(r["recipe"], r["budget"]) for r in result["rows"]] == [("full", "1"), ("snapkv", "0.5"), ("knorm", "0.25")]
    assert result["config"]["budgets"] == ["0.5", "0.25"]


def test_lm_eval_entry_point_adds_the_task_folder(monkeypatch):
    import sys

    import lm_eval.__main__

    from kvcompile import cli
    from kvcompile.eval.lm_eval_cli import TASKS_DIR

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["kvcompile"])
    cli.main(["lm-eval", "--model", "kvcompile", "--tasks", "kvc_passkey"])
    assert seen == [["lm-eval", "--model", "kvcompile", "--tasks", "kvc_passkey", "--include_path", str(TASKS_DIR)]]
    assert {p.stem for p in TASKS_DIR.glob("kvc_*.yaml")} == {f"kvc_{name}" for name in TASKS}


def test_the_package_declares_its_lm_eval_model_plugin():
    """``lm_eval --model kvcompile`` through lm-eval's plug-in entry points (``lm_eval.models``), for a release that
    reads them: the installed package declares the harness's model class there."""
    from importlib.metadata import entry_points

    from kvcompile.eval.harness import KVCompileLM

    (point,) = [e for e in entry_points(group="lm_eval.models") if e.name == "kvcompile"]
    assert point.load() is KVCompileLM
