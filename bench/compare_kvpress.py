"""kvcompile recipes against NVIDIA kvpress presses: same model, prompts, budgets; accuracy, KL, wall time, bytes held.

kvpress 0.5.5 needs transformers < 5.3 while kvcompile needs transformers 5.x, so the run has three steps in two
environments, joined by JSON files:

1. ``python bench/compare_kvpress.py prompts``  (kvcompile env): the task prompts as token ids, plus the
   full-budget answer each one is teacher-forced with for KL; also saves the model in HF format for step 2.
2. ``<kvpress venv>/bin/python bench/compare_kvpress.py kvpress``: every press x compression ratio on those
   prompts (compress the context, then read the question at its original positions and decode greedily, as
   kvpress's own pipeline does); bytes held = every tensor the cache keeps after compression plus the head masks
   AdaKV stores on the attention modules (kvpress masks evicted keys, it does not free them).
3. ``python bench/compare_kvpress.py kvcompile`` (kvcompile env): the matching recipes on the same prompts
   (``kvcompile.eval.sweep``), then the merged table ``bench/results/compare_kvpress/kvpress.{json,md,png}``.

Step 2 imports nothing from kvcompile, so it runs where kvcompile cannot be installed. Steps 2 and 3 are
independent until the merge: ``--presses`` runs a subset of ``PAIRS`` (by kvpress name; the cells land in the same
raw file, replacing earlier ones of that press and budget), and ``python bench/compare_kvpress.py merge`` writes the
table from the two raw files (step 3 also writes it when step 2's file exists). Both resume where a cut run
stopped: step 2 skips every cell its raw file holds in full (``--redo`` runs them again), step 3 keeps each finished
context's rows in ``kvcompile.sqlite`` (a ``kvcompile.eval.store.Store``) and builds its cells from every stored row.
The grid of the docs (4 tasks x 10 samples x 3 budgets x 35 pairs) is about 7 CPU-hours a side at one thread, more
than one session's machine: ``save`` copies what is finished to ``bench/results/compare_kvpress/kvpress_grid/``
(``--keep``), and on a new machine ``prompts`` then ``restore`` put it back before the steps resume. Set
``HF_HUB_OFFLINE=1`` for step 2 where the hub cannot be reached, so a press that downloads (DuoAttention's dataset)
fails at once instead of retrying; Q-Filters reads the filters the prompts step calibrated on this model
(`qfilters.json`) on both sides.

kvpress presses that need attention weights (ObservedAttention) run with eager attention during the context
prefill, as kvpress requires; everything else runs with sdpa. Every prompt starts from a model without head masks:
kvpress leaves a masked press's ``masked_key_indices`` on the attention modules, only an sdpa prefill resets them,
and KVCompose's eager prefill would otherwise decode through the previous press's masks. Recipes with a
``prefill_chunk`` (``block+keydiff``) are run prompt by prompt from an empty cache, since ``sweep.run`` forks one
shared unchunked prefill.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from record import Results, default_stem

PAIRS = [  # (kvpress press, kvcompile recipe); kvpress hyperparameters are set to the recipe's
    ("StreamingLLM", "streamingllm"),
    ("Knorm", "knorm"),
    ("SnapKV", "snapkv"),
    ("AdaKV(SnapKV)", "adakv-snapkv"),
    ("ExpectedAttention", "expected-attention"),
    ("TOVA", "tova"),
    ("PyramidKV", "pyramidkv"),
    ("KeyDiff", "keydiff"),
    ("ObservedAttention", "observed-attention"),
    ("LagKV", "lagkv"),
    ("NonCausalAttn", "noncausal-attention"),
    ("LeverageScore", "leverage-score"),
    ("CURPress", "cur"),
    ("CapPress", "cappress"),
    ("QFilter", "qfilter-calibrated"),
    ("Compactor", "compactor"),
    ("CriticalKV(SnapKV)", "criticalkv"),
    ("KVzip", "kvzip"),
    ("KVCompose", "kvcompose"),
    ("ChunkKV(SnapKV)", "chunkkv+snapkv"),
    ("EntropyGatedChunkKV(SnapKV)", "entropy-gated-chunkkv+snapkv"),
    ("ChunkPress(SnapKV)", "chunk+snapkv"),
    ("BlockPress(KeyDiff)", "block+keydiff"),
    ("AdaKV(Knorm)", "adakv+knorm"),
    ("Random", "random"),
    ("CriticalAdaKV(SnapKV)", "adakv-criticalkv"),
    ("AdaKV(ExpectedAttention)", "adakv-expected-attention"),
    ("KeyRerotation(SnapKV)", "key-rerotation+snapkv"),
    ("Merging(SnapKV)", "merging+snapkv"),
    ("PerLayerCompression(SnapKV)", "per-layer+snapkv"),
    ("Composed(Knorm+SnapKV)", "composed+snapkv"),
    ("KVgrad", "kvgrad"),
    ("LUKV(ExpectedAttention)", "lukv"),
    ("DuoAttention", "duoattention"),
    ("SimLayerKV", "simlayerkv"),
]
# Left out, with the reason in docs/kvpress.md: FinchPress ranks the context by the question (query-aware) and this
# protocol compresses the context before the question is read; the decode-time presses (DecodingPress,
# CompressionRatioDecodingPress, PrefillDecodingPress, CAMPress) compress while generating, and these answers are a
# few tokens long; the learned presses (KVzap, DMS, FastKVzip, RestoreKV) load weights from the hub.
COMPOSED_KEEP = 0.5  # ComposedPress([KnormPress(1 - COMPOSED_KEEP), SnapKVPress(...)]): Knorm's share


def _ramp(n_layers: int) -> list[float]:
    """PerLayerCompression's per-layer shares of the budget: lower layers keep half the mean, the top 1.5x."""
    return [0.5 + layer / max(n_layers - 1, 1) for layer in range(n_layers)]


def _recipe(name: str, n_layers: int, folder: Path):
    """The kvcompile recipe of a pair: by name, or built for the compositions whose parameters kvpress also sets,
    and Q-Filters with the filters both sides read (``qfilters.json``, written by the prompts step)."""
    import dataclasses

    import kvcompile
    from kvcompile.recipes import compose

    if name == "qfilter-calibrated":
        filters = json.loads((folder / "qfilters.json").read_text())["filters"]
        return dataclasses.replace(kvcompile.get_recipe("qfilter"), name=name, scorer_args={"filters": filters})
    if name == "per-layer+snapkv":  # kept shares in proportion to the ramp, rescaled to the budget
        return compose("per-layer", "snapkv", compression_ratios=[1 - s / 1.5 for s in _ramp(n_layers)])
    if name == "composed+snapkv":
        return compose("composed", "snapkv", first="knorm", keep=COMPOSED_KEEP)
    return kvcompile.get_recipe(name)
EAGER = {"ObservedAttention"}  # kvpress reads the attention weights, which only eager attention returns
DEFAULT_DIR = Path("/tmp/kvc/kvpress")


def _prompts(args) -> None:
    import torch

    import kvcompile
    from kvcompile.eval.decoding import greedy, ids_tensor, read_question
    from kvcompile.eval.synthetic import get_task, make_sample

    model, tok = kvcompile.load_model(args.model)
    model.hf_quantizer = None  # a first load from GGUF keeps a quantizer that refuses save_pretrained; the
    model.save_pretrained(args.dir / "model")  # weights it loaded are plain tensors of the model's dtype
    tok.save_pretrained(args.dir / "model")
    config = json.loads((args.dir / "model" / "config.json").read_text())
    config.pop("quantization_config", None)  # a null entry left by the GGUF load breaks older transformers
    (args.dir / "model" / "config.json").write_text(json.dumps(config, indent=1))
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    rows = []
    for name in args.tasks.split(","):
        task = get_task(name)
        for index in range(args.n_samples):
            sample = make_sample(task, tok, args.length, seed=args.seed, index=index)
            context, question = (tok(t, add_special_tokens=False)["input_ids"] for t in sample.prompt(tok))
            cm.reset()
            with torch.no_grad():
                cm.prefill(ids_tensor(context, cm.device), logits="last")
            answer = greedy(cm, read_question(cm, question), task.max_new_tokens, eos_ids={tok.eos_token_id})
            rows.append({"task": name, "index": index, "context": context, "question": question,
                         "answers": list(sample.answers), "max_new_tokens": task.max_new_tokens,
                         "reference": question + answer})
    (args.dir / "prompts.json").write_text(json.dumps({"model": args.model, "length": args.length, "seed": args.seed,
                                                       "n_samples": args.n_samples, "tasks": args.tasks,
                                                       "prompts": rows}))
    _qfilters(cm, tok, args.dir)


def _qfilters(cm, tok, folder: Path) -> None:
    """Q-Filters calibrated on this model's own queries over offline prose (8 windows of 512 tokens), for both
    sides: kvpress downloads published filters, which cannot be reached here (and none exist for SmolLM2)."""
    import torch

    from kvcompile.calibration.qfilter import calibrate
    from kvcompile.eval.fidelity import prose_windows

    samples = [torch.tensor([w]) for w in prose_windows(tok, 8, 512)]
    (folder / "qfilters.json").write_text(json.dumps({"filters": calibrate(cm, samples)}))


def _press(name: str, ratio: float, n_layers: int):
    """The kvpress press for ``name`` at ``compression_ratio=ratio``, with the kvcompile recipe's hyperparameters
    (``kvcompile.get_recipe(name).scorer_args`` / ``allocator_args``); kvpress defaults where they already agree."""
    import kvpress as kp

    expected = lambda epsilon: kp.ExpectedAttentionPress(  # noqa: E731
        compression_ratio=ratio, n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True,
        epsilon=epsilon)

    snap = lambda: kp.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)  # noqa: E731
    return {
        "StreamingLLM": lambda: kp.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "Knorm": lambda: kp.KnormPress(compression_ratio=ratio),
        "SnapKV": snap,
        "AdaKV(SnapKV)": lambda: kp.AdaKVPress(snap(), alpha_safeguard=0.2),
        "ExpectedAttention": lambda: expected(0.0),
        "TOVA": lambda: kp.TOVAPress(compression_ratio=ratio),
        "PyramidKV": lambda: kp.PyramidKVPress(compression_ratio=ratio, window_size=32, kernel_size=7, beta=20),
        "KeyDiff": lambda: kp.KeyDiffPress(compression_ratio=ratio),
        "ObservedAttention": lambda: kp.ObservedAttentionPress(compression_ratio=ratio),
        "LagKV": lambda: kp.LagKVPress(compression_ratio=ratio, n_sink=4, lag_size=128, cross_scoring=False),
        "NonCausalAttn": lambda: kp.NonCausalAttnPress(compression_ratio=ratio, chunk_size=256),
        "LeverageScore": lambda: kp.LeverageScorePress(compression_ratio=ratio, sketch_dimension=48),
        "CURPress": lambda: kp.CURPress(compression_ratio=ratio, num_sinks=4, leverage_type="kv_product",
                                        use_random_leverage=False, use_local_approximation=True,
                                        local_window_size=16),
        "CapPress": lambda: kp.CapPress(compression_ratio=ratio, tau=5.0, n_future_positions=512, n_sink=4,
                                        epsilon=1e-6),
        "QFilter": lambda: kp.QFilterPress(compression_ratio=ratio),  # the filters of qfilters.json (_kvpress)
        "Compactor": lambda: kp.CompactorPress(compression_ratio=ratio, sink_size_start=8, sink_size_end=4,
                                               chunk_size=256, sketch_dimension=48, blending=0.35),
        "CriticalKV(SnapKV)": lambda: kp.CriticalKVPress(snap(), epsilon=1e-4, first_stage_ratio=0.5),
        "KVzip": lambda: kp.KVzipPress(compression_ratio=ratio, n_sink=4),
        "KVCompose": lambda: kp.KVComposePress(compression_ratio=ratio, structured=True, agg_task="max",
                                               agg_group="mean", agg_head="mean", add_v_norm=False,
                                               add_mean_across_heads=True, keep_token_lower_bound=0),
        "ChunkKV(SnapKV)": lambda: kp.ChunkKVPress(snap(), chunk_length=20),
        "EntropyGatedChunkKV(SnapKV)": lambda: kp.EntropyGatedChunkKVPress(snap(), chunk_length=10,
                                                                           low_entropy_chunk_length=4),
        "ChunkPress(SnapKV)": lambda: kp.ChunkPress(snap(), chunk_length=1024),
        "BlockPress(KeyDiff)": lambda: kp.BlockPress(kp.KeyDiffPress(compression_ratio=ratio), block_size=128),
        "AdaKV(Knorm)": lambda: kp.AdaKVPress(kp.KnormPress(compression_ratio=ratio), alpha_safeguard=0.2),
        "Random": lambda: kp.RandomPress(compression_ratio=ratio, seed=0),
        "CriticalAdaKV(SnapKV)": lambda: kp.CriticalAdaKVPress(snap(), alpha_safeguard=0.2, epsilon=1e-4,
                                                               first_stage_ratio=0.5),
        "AdaKV(ExpectedAttention)": lambda: kp.AdaKVPress(expected(0.01), alpha_safeguard=0.2),
        "KeyRerotation(SnapKV)": lambda: kp.KeyRerotationPress(snap()),
        "Merging(SnapKV)": lambda: kp.MergingPress(snap(), similarity_threshold=0.0, merge_fraction=1.0),
        "PerLayerCompression(SnapKV)": lambda: kp.PerLayerCompressionPress(
            snap(), compression_ratios=[1 - (1 - ratio) * s for s in _ramp(n_layers)]),
        "Composed(Knorm+SnapKV)": lambda: kp.ComposedPress([
            kp.KnormPress(compression_ratio=1 - COMPOSED_KEEP),
            kp.SnapKVPress(compression_ratio=max(0.0, 1 - (1 - ratio) / COMPOSED_KEEP), window_size=32,
                           kernel_size=7)]),
        "KVgrad": lambda: kp.KVgradPress(compression_ratio=ratio, n_sink=4),
        "LUKV(ExpectedAttention)": lambda: kp.LUKVPress(expected(0.02), compression_ratio=ratio),  # its own curve
        "DuoAttention": lambda: kp.DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=True),  # no hub
        "SimLayerKV": lambda: kp.SimLayerKVPress(lazy_threshold=0.9, n_last=1, n_recent=64, n_initial=4),
    }[name]()


def _selected(args) -> list[tuple[str, str]]:
    if not args.presses:
        return PAIRS
    names = args.presses.split(",")
    unknown = [n for n in names if n not in dict(PAIRS)]
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; known: {[p for p, _ in PAIRS]}")
    return [p for p in PAIRS if p[0] in names]


def _update(path: Path, key: str, new: list, same: dict) -> list:
    """Cells of ``path`` (if it holds a run on the same prompts) with ``new`` replacing those of the same method
    and budget; written back to ``path``."""
    old = json.loads(path.read_text()) if path.exists() else {}
    cells = old.get(key, []) if all(old.get(k) == v for k, v in same.items()) else []
    done = {(c["press"], c["budget"]) for c in new}
    cells = [c for c in cells if (c["press"], c["budget"]) not in done] + new
    path.write_text(json.dumps({**old, **same, key: cells}))
    return cells


def _prompt_key(data: dict) -> dict:
    return {k: data[k] for k in ("model", "length", "seed", "n_samples", "tasks")}


def per_prompt(rows, data, name, budget, version=None):
    """{prompt index: (score, KL mean, KL tokens)} of one recipe's stored rows (the prompts step's order)."""
    index, seen = {}, {}
    for i, q in enumerate(data["prompts"]):  # a task's samples in order
        index[(q["task"], seen.get(q["task"], 0))] = i
        seen[q["task"]] = seen.get(q["task"], 0) + 1
    return {index[(r["task"], r["sample"])]: (r["score"], r["kl_mean"], r["kl_tokens"]) for r in rows
            if r["recipe"] == name and float(r["budget"]) == budget and not r["error"]
            and (version is None or r["version"] == version) and (r["task"], r["sample"]) in index}


def _held_bytes(model, cache) -> int:
    """Bytes of every tensor the cache keeps, plus the eviction masks presses leave on attention modules."""
    import torch

    total = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    for module in model.modules():
        for key, value in vars(module).items():
            if "mask" in key and value is not None:
                tensors = value if isinstance(value, (tuple, list)) else (value,)
                total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


def _kvpress(args) -> None:
    import contextlib
    import copy

    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    data = json.loads((args.dir / "prompts.json").read_text())
    if (args.dir / "qfilters.json").exists():  # kvpress scores -<f, k>, kvcompile +<u, k>: f = -u
        filters = -torch.tensor(json.loads((args.dir / "qfilters.json").read_text())["filters"])
        kvpress.QFilterPress.load_q_filters = staticmethod(lambda model_name: filters)
    model = AutoModelForCausalLM.from_pretrained(args.dir / "model", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(args.dir / "model")
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    n_layers = model.config.num_hidden_layers

    @contextlib.contextmanager
    def attention(implementation):
        saved = model.config._attn_implementation
        model.config._attn_implementation = implementation  # read at every forward
        try:
            yield
        finally:
            model.config._attn_implementation = saved

    def read(ids, cache, start, **kwargs):
        """The model over ``ids`` at positions start.., after ``cache``. A press that leaves the layers holding
        different lengths (PerLayerCompression, KVCompose) breaks the attention mask of a multi-token step
        (transformers builds one mask from one layer's length), so then the tokens go one at a time: the same
        attention, one step per token."""
        if len({cache.get_seq_length(layer) for layer in range(n_layers)}) == 1:
            pos = torch.arange(start, start + len(ids))[None]
            return model(torch.tensor([ids]), past_key_values=cache, position_ids=pos, **kwargs).logits[0]
        steps = [model(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[start + i]])).logits[0]
                 for i, t in enumerate(ids)]
        return torch.cat(steps)[-1:] if kwargs.get("logits_to_keep") == 1 else torch.cat(steps)

    def run(prompt, press, implementation="sdpa"):
        """(answer text, reference logits [T, V], bytes held, seconds) for one prompt under ``press`` (None: full)."""
        ctx = torch.tensor([prompt["context"]])
        n = ctx.shape[1]
        for module in model.modules():  # a fresh model: kvpress leaves head masks on the attention modules, and an
            if getattr(module, "masked_key_indices", None) is not None:  # eager prefill (KVCompose) does not reset them
                module.masked_key_indices = None
        t0 = time.perf_counter()
        cache = DynamicCache()
        with torch.no_grad():
            with press(model) if press is not None else contextlib.nullcontext(), attention(implementation):
                model.model(input_ids=ctx, past_key_values=cache)  # by keyword, as kvpress's pipeline (KVzip reads it)
            held = _held_bytes(model, cache)
            ref_cache = copy.deepcopy(cache)
            if isinstance(press, kvpress.KeyRerotationPress):  # as kvpress's pipeline: the kept keys now sit at
                n = cache.get_seq_length()  # 0..m-1, so the question starts at m, not at the context's length
            out = read(prompt["question"], cache, n, logits_to_keep=1)
            tokens, p = [int(out[-1].argmax())], n + len(prompt["question"])
            while tokens[-1] not in eos and len(tokens) < prompt["max_new_tokens"]:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[p]]))
                tokens.append(int(out.logits[0, -1].argmax()))
                p += 1
            seconds = time.perf_counter() - t0
            logits = read(prompt["reference"], ref_cache, n)[:-1]
        return tok.decode(tokens, skip_special_tokens=True), logits, held, seconds

    t_start = time.perf_counter()
    saved = args.dir / "kvpress_full.pt"  # the full-budget runs, reused by later invocations on the same prompts
    full = torch.load(saved) if saved.exists() else None
    if full is None or full["prompts"] != _prompt_key(data):
        full = {"prompts": _prompt_key(data), "runs": {i: run(p, None) for i, p in enumerate(data["prompts"])}}
        torch.save(full, saved)
    full = full["runs"]
    cells = [("full", 1.0)] + [(name, b) for b in args.budgets for name, _ in _selected(args)]  # a budget at a time
    key = {"prompts": _prompt_key(data), "kvpress": _version("kvpress"), "transformers": _version("transformers")}
    raw = args.dir / "kvpress_raw.json"
    old = json.loads(raw.read_text()) if raw.exists() and not args.redo else {}
    if all(old.get(k) == v for k, v in key.items()):  # a resumed run: the cells run to the end are kept
        done = {(c["press"], c["budget"]) for c in old["cells"] if len(c["scores"]) == len(data["prompts"])}
        cells = [c for c in cells if c not in done]
    for name, budget in cells:
        cell = {"press": name, "budget": budget, "scores": [], "kl": [], "top1": [], "held": [], "seconds": [],
                "answers": []}
        try:
            for i, prompt in enumerate(data["prompts"]):
                implementation = "eager" if name in EAGER else "sdpa"
                text, logits, held, seconds = (full[i] if name == "full" else
                                               run(prompt, _press(name, 1 - budget, n_layers), implementation))
                lp_full, lp = torch.log_softmax(full[i][1].float(), -1), torch.log_softmax(logits.float(), -1)
                cell["kl"] += (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0).tolist()
                cell["top1"] += (lp_full.argmax(-1) == lp.argmax(-1)).float().tolist()
                pred = text.lower()
                cell["scores"].append(sum(a.lower() in pred for a in prompt["answers"]) / len(prompt["answers"]))
                cell["held"].append(held)
                cell["seconds"].append(seconds)
                cell["answers"].append(text)
        except Exception as e:  # noqa: BLE001 - a press that fails is a result
            cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        _update(raw, "cells", [cell], key)  # after every cell: a cut run keeps its cells
        print(name, budget, cell.get("error") or sum(cell["scores"]) / max(len(cell["scores"]), 1),
              f"{time.perf_counter() - t_start:.0f}s", flush=True)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _separate(cm, tok, recipe, budgets, data) -> list[dict]:
    """Cells of ``recipe`` run prompt by prompt from an empty cache (prefill, compress, answer; KL teacher-forced on
    the reference), for recipes the shared-prefill sweep cannot run as they are (``prefill_chunk``)."""
    import torch

    import kvcompile
    from kvcompile.eval.decoding import greedy, ids_tensor, read_question
    from kvcompile.eval.fidelity import next_token_metrics, summarize
    from kvcompile.eval.samples import string_match_all

    eos = {t for t in (tok.eos_token_id, getattr(cm.generation_config, "eos_token_id", None)) if isinstance(t, int)}
    refs = []
    for prompt in data["prompts"]:  # full-budget logits on the reference, as the sweep's full cell computes them
        cm.reset()
        with torch.no_grad():
            cm.prefill(ids_tensor(prompt["context"], cm.device), logits="last")
            refs.append(cm.prefill(ids_tensor(prompt["reference"], cm.device), compress=False)[0, :-1])
    cells = []
    for budget in budgets:
        model = kvcompile.apply(cm, budget=budget, recipe=recipe)
        cell = {"press": recipe.name, "budget": budget, "n": 0, "score": 0.0, "held": 0.0, "wall": 0.0, "error": None}
        parts = []
        try:
            for prompt, ref in zip(data["prompts"], refs):
                t0 = time.perf_counter()
                model.reset()
                with torch.no_grad():
                    model.prefill(ids_tensor(prompt["context"], model.device), logits="last")
                stats = model.cache_stats()
                probe = model.fork()
                tokens = greedy(model, read_question(model, prompt["question"]), prompt["max_new_tokens"],
                                eos_ids=eos)
                cell["wall"] += time.perf_counter() - t0
                with torch.no_grad():
                    logits = probe.prefill(ids_tensor(prompt["reference"], probe.device), compress=False)[0, :-1]
                parts.append(next_token_metrics(ref, logits, torch.tensor(prompt["reference"][1:])))
                cell["score"] += string_match_all(prompt["answers"], tok.decode(tokens, skip_special_tokens=True))
                cell["held"] += stats["bytes_held"]
                cell["n"] += 1
        except Exception as e:  # noqa: BLE001
            cell["error"] = f"{type(e).__name__}: {e}"
        if parts:
            m = summarize(parts)
            cell["kl"], cell["top1"] = m["kl_mean"] * cell["n"], m["top1"] * cell["n"]
        cell["prefill_included"] = True
        cells.append(cell)
    return cells


def _kvcompile(args) -> None:
    import kvcompile
    from kvcompile.eval import sweep
    from kvcompile.eval.store import Store

    data = json.loads((args.dir / "prompts.json").read_text())
    model, tok = kvcompile.load_model(data["model"])
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    pairs = _selected(args)
    recipes, chunked, missing = [], [], []
    for _, name in pairs:
        try:
            recipe = _recipe(name, model.config.num_hidden_layers, args.dir)
            (chunked if recipe.prefill_chunk else recipes).append(recipe)
        except (KeyError, ValueError):
            missing.append(name)
    t0 = time.perf_counter()
    with Store(args.dir / "kvcompile.sqlite") as store:  # a cut run keeps every context it finished
        res = sweep.run(cm, tok, recipes, args.budgets, data["tasks"].split(","), n_samples=data["n_samples"],
                        length=data["length"], seed=data["seed"], kl=True, store=store, model=data["model"],
                        ledger_mass=False)  # the table reads no ledger: a quarter of the sweep's time saved
        rows = store.rows()
    contexts = res["timing"]["contexts"]
    prefill = res["timing"]["shared_prefill_s"] / contexts if contexts else None  # None: every context was stored
    versions = {r.name: r.version for r in recipes} | {"full": kvcompile.recipes()["full"].version}
    ours, latest = {}, {}
    for r in rows:  # one row per sample: a refactor's new fingerprint (same version, same results) stores it again
        latest[(r["recipe"], r["budget"], r["task"], r["sample"], r["length"], r["seed"], r["version"])] = r
    for r in latest.values():  # this run's cells, from every stored sample of the prompts (this run's or earlier)
        if (versions.get(r["recipe"]) != r["version"] or float(r["budget"]) not in args.budgets + [1.0]
                or r["task"] not in data["tasks"].split(",") or r["sample"] >= data["n_samples"]
                or (r["length"], r["seed"]) != (data["length"], data["seed"])):
            continue
        o = ours.setdefault((r["recipe"], float(r["budget"])), {
            "press": r["recipe"], "budget": float(r["budget"]), "n": 0, "score": 0.0, "held": 0.0, "kl": 0.0,
            "top1": 0.0, "wall": 0.0, "kl_tokens": 0, "error": None, "prefill_s": prefill})
        if r["error"]:
            o["error"] = r["error"]
            continue
        o["n"] += 1
        o["score"], o["held"], o["wall"] = o["score"] + r["score"], o["held"] + r["bytes_held"], o["wall"] + r["wall_s"]
        o["kl"] += r["kl_mean"] * r["kl_tokens"]  # token-weighted, as kvpress's side pools every token
        o["top1"] += r["top1"] * r["kl_tokens"]
        o["kl_tokens"] += r["kl_tokens"]
    for o in ours.values():  # per prompt, as the merge reads them
        o["kl"], o["top1"] = (o[k] / max(o["kl_tokens"], 1) * o["n"] for k in ("kl", "top1"))
    cells = list(ours.values())
    for name in chunked:
        cells += _separate(cm, tok, name, args.budgets, data)
    cells += [{"press": name, "budget": b, "n": 0, "error": "no such recipe in kvcompile"} for name in missing
              for b in args.budgets]
    print(f"kvcompile cells: {time.perf_counter() - t0:.0f}s", flush=True)
    _update(args.dir / "kvcompile_raw.json", "cells", cells,
            {"prompts": _prompt_key(data), "kvcompile": _version("kvcompile")})
    if (args.dir / "kvpress_raw.json").exists():
        _merge(args)


def _fmt(value, spec: str) -> str:
    """A table cell: ``value`` formatted, or "-" where a side has none."""
    return "-" if value is None else format(value, spec)


def _merge(args) -> None:
    data = json.loads((args.dir / "prompts.json").read_text())
    raw = json.loads((args.dir / "kvpress_raw.json").read_text())
    ours = json.loads((args.dir / "kvcompile_raw.json").read_text())
    for r in (raw, ours):
        if r["prompts"] != _prompt_key(data):
            raise SystemExit(f"raw results are for other prompts: {r['prompts']} vs {_prompt_key(data)}")
    rows = []
    for press, recipe in [("full", "full")] + PAIRS:
        for budget in [1.0] if press == "full" else args.budgets:
            kp = next((c for c in raw["cells"] if c["press"] == press and c["budget"] == budget), None)
            o = next((c for c in ours["cells"] if c["press"] == recipe and c["budget"] == budget), None)
            if kp is None or o is None:  # only cells both sides ran (a failure counts as run)
                continue
            row = {"method": press, "recipe": recipe, "budget": budget}
            if kp:
                row.update(kvpress_score=_mean(kp["scores"]), kvpress_kl=_mean(kp["kl"]),
                           kvpress_top1=_mean(kp["top1"]), kvpress_bytes_held=_mean(kp["held"]),
                           kvpress_s_per_prompt=_mean(kp["seconds"]), kvpress_error=kp.get("error"),
                           kvpress_scores=kp["scores"], kvpress_answers=kp.get("answers"))
            if o and o["n"]:
                prefill = 0.0 if o.get("prefill_included") else o["prefill_s"] or 0.0
                row.update(kvcompile_score=o["score"] / o["n"], kvcompile_kl=o["kl"] / o["n"],
                           kvcompile_top1=o["top1"] / o["n"], kvcompile_bytes_held=o["held"] / o["n"],
                           kvcompile_s_per_prompt=o["wall"] / o["n"] + prefill, kvcompile_error=o["error"])
            elif o:
                row["kvcompile_error"] = o["error"]
            rows.append(row)
    out = Results("compare_kvpress", args.out, name="kvpress")
    meta = {"model": data["model"], "length": data["length"], "tasks": data["tasks"], "n_samples": data["n_samples"],
            "seed": data["seed"], "budgets": args.budgets, "kvpress": raw["kvpress"],
            "transformers_for_kvpress": raw["transformers"], "kvcompile": ours["kvcompile"]}
    out.json({"meta": meta, "rows": rows})
    lines = [f"kvcompile vs kvpress {raw['kvpress']} on {data['model']}, {data['tasks']} @ {data['length']} tokens, "
             f"{data['n_samples']} samples per task, query-agnostic. Bytes: K/V held per prompt after compressing the "
             "context (kvpress: cache tensors + masks). Seconds: per prompt, prefill + compress + answer "
             "(kvcompile: its shared prefill counted once per cell)."
             + (" The seconds were measured at low priority on a machine shared with other work: they are not a "
                "speed comparison." if args.under_load else ""), "",
             "| method | budget | score kvc | score kvp | KL kvc | KL kvp | top-1 kvc | top-1 kvp | MiB kvc | MiB kvp "
             "| s kvc | s kvp | note |", "|" + "---|" * 13]
    for r in rows:
        mib = lambda v: None if v is None else v / 2**20  # noqa: E731
        note = "; ".join(e for e in (r.get("kvcompile_error"), r.get("kvpress_error")) if e).replace("|", "/")
        lines.append(
            f"| {r['method']} | {r['budget']:g} | {_fmt(r.get('kvcompile_score'), '.2f')}"
            f" | {_fmt(r.get('kvpress_score'), '.2f')} | {_fmt(r.get('kvcompile_kl'), '.3f')}"
            f" | {_fmt(r.get('kvpress_kl'), '.3f')} | {_fmt(r.get('kvcompile_top1'), '.2f')}"
            f" | {_fmt(r.get('kvpress_top1'), '.2f')} | {_fmt(mib(r.get('kvcompile_bytes_held')), '.2f')}"
            f" | {_fmt(mib(r.get('kvpress_bytes_held')), '.2f')} | {_fmt(r.get('kvcompile_s_per_prompt'), '.1f')}"
            f" | {_fmt(r.get('kvpress_s_per_prompt'), '.1f')} | {note} |")
    lines += ["", *_pivot(rows, args.budgets)]
    out.markdown("\n".join(lines))
    out.figure(_plot([r for r in rows if r["method"] != "full"]))
    print("\n".join(lines))


def _pivot(rows: list[dict], budgets: list[float]) -> list[str]:
    """The table above, one line per press: KL (kvcompile / kvpress) at each budget, and the MiB each holds at the
    middle one (kvpress's masks counted)."""
    mid = sorted(budgets)[len(budgets) // 2]
    head = " | ".join(f"KL at {b:g}" for b in budgets)
    lines = [f"By press: next-token KL, kvcompile / kvpress; MiB held at {mid:g}.", "",
             f"| method | {head} | MiB at {mid:g} |", "|---|" + "---|" * (len(budgets) + 1)]
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
        cells = {r["budget"]: r for r in rows if r["method"] == method}
        kl = [_fmt(cells.get(b, {}).get("kvcompile_kl"), ".3f") + " / "
              + _fmt(cells.get(b, {}).get("kvpress_kl"), ".3f") for b in budgets]
        held = [cells.get(mid, {}).get(f"{side}_bytes_held") for side in ("kvcompile", "kvpress")]
        held = [_fmt(None if b is None else b / 2**20, ".2f") for b in held]
        lines.append(f"| {method} | {' | '.join(kl)} | {' / '.join(held)} |")
    return lines


def _plot(rows: list[dict]):
    """Two panels, a point per (press, budget) both sides ran: next-token KL of kvcompile against kvpress's (on the
    diagonal they agree), and the bytes each holds (kvpress's masked presses sit far right of the budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    colors = {0.5: "tab:blue", 0.25: "tab:orange", 0.1: "tab:red"}
    for ax, key, label in ((axes[0], "kl", "next-token KL vs the full cache"),
                           (axes[1], "bytes_held", "K/V MiB held per prompt")):
        scale = 2**-20 if key == "bytes_held" else 1.0
        pts = [(r[f"kvpress_{key}"] * scale, r[f"kvcompile_{key}"] * scale, r["budget"], r["method"]) for r in rows
               if r.get(f"kvpress_{key}") is not None and r.get(f"kvcompile_{key}") is not None]
        for budget, color in colors.items():
            xs = [(x, y) for x, y, b, _ in pts if b == budget]
            if xs:
                ax.scatter(*zip(*xs), s=18, color=color, label=f"budget {budget:g}")
        for x, y, _, name in pts:  # name the points off the diagonal: KL apart by over 0.05, bytes by over a quarter
            if abs(y - x) > (0.05 if key == "kl" else 0.25 * max(x, y)):
                ax.annotate(name, (x, y), fontsize=6, alpha=0.8)
        top = max(max(x, y) for x, y, _, _ in pts) * 1.05 if pts else 1.0
        ax.plot([0, top], [0, top], "k:", lw=1)
        ax.set_xlabel(f"kvpress: {label}")
        ax.set_ylabel(f"kvcompile: {label}")
        ax.legend(fontsize=8)
    axes[0].set_title("Same prompts, same budget: where the two libraries agree")
    axes[1].set_title("Bytes really held (kvpress's masks counted)")
    fig.tight_layout()
    return fig


def _save(args) -> None:
    """Copy what both sides finished (kvpress's raw cells, kvcompile's stored rows as JSON, both gzipped) and the
    Q-Filters to ``--keep``, so a grid that outlives one machine goes on from there (``restore``)."""
    import gzip

    from kvcompile.eval.store import Store

    keep = Results("compare_kvpress", args.keep)  # the folder's record: <keep>.record.json beside it
    keep.path("/qfilters.json").write_text((args.dir / "qfilters.json").read_text())  # what QFilter cells read
    with Store(args.dir / "kvcompile.sqlite") as store:
        rows = store.rows()
    raw = (args.dir / "kvpress_raw.json").read_text()
    for name, text in (("kvpress_raw.json.gz", raw), ("kvcompile_rows.json.gz", json.dumps(rows))):
        with gzip.open(keep.path("/" + name), "wt") as f:
            f.write(text)
    print(f"kept {len(json.loads(raw)['cells'])} kvpress cells and {len(rows)} kvcompile rows in {args.keep}")


def _restore(args) -> None:
    """Put a ``save``d grid back into ``--dir`` (after the ``prompts`` step, which regenerates the same prompts).
    A row of a recipe at its current version is stored under its current fingerprint: a fingerprint re-recorded at
    the same version is a refactor with identical results (``kvcompile.recipes.fingerprint``), so the sweep need
    not run the cell again."""
    import gzip

    import kvcompile
    from kvcompile.eval.store import KEY, VALUES, Store

    (args.dir / "qfilters.json").write_text((args.keep / "qfilters.json").read_text())  # not a recalibration
    with gzip.open(args.keep / "kvpress_raw.json.gz", "rt") as f:
        (args.dir / "kvpress_raw.json").write_text(f.read())
    n_layers = json.loads((args.dir / "model" / "config.json").read_text())["num_hidden_layers"]
    current = {"full": kvcompile.get_recipe("full")}
    for _, name in PAIRS:
        try:
            recipe = _recipe(name, n_layers, args.dir)
        except (KeyError, ValueError):  # not in kvcompile: no rows
            continue
        current[recipe.name] = recipe
    current = {name: (r.version, r.fingerprint) for name, r in current.items()}
    with gzip.open(args.keep / "kvcompile_rows.json.gz", "rt") as f:
        rows = json.load(f)
    for r in rows:
        version, fingerprint = current.get(r["recipe"], (None, None))
        if r["version"] == version:
            r["fingerprint"] = fingerprint
    with Store(args.dir / "kvcompile.sqlite") as store:
        added = store.add([{k: r[k] for k in KEY + VALUES if k in r and not k.endswith(("_version", "created"))}
                           for r in rows])
    print(f"restored the kvpress cells and {added} of {len(rows)} kvcompile rows into {args.dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prompts", "kvpress", "kvcompile", "merge", "save", "restore"])
    parser.add_argument("--keep", type=Path, default=default_stem("compare_kvpress", "kvpress_grid"),
                        help="save / restore: where an unfinished grid is kept between machines")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the steps exchange files")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--n-samples", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0.5,0.25,0.1")
    parser.add_argument("--redo", action="store_true", help="kvpress step: run again the cells already in its raw "
                        "file (by default a run resumes: it skips every cell that ran to the end)")
    parser.add_argument("--presses", default="", help="comma-separated kvpress names from PAIRS (default: all)")
    parser.add_argument("--out", help="merge: path stem of the table (default bench/results/compare_kvpress/kvpress)")
    parser.add_argument("--under-load", action="store_true", help="say in the table that its seconds are not a speed "
                                                                   "comparison (a run sharing the machine)")
    args = parser.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.dir.mkdir(parents=True, exist_ok=True)
    {"prompts": _prompts, "kvpress": _kvpress, "kvcompile": _kvcompile, "merge": _merge, "save": _save,
     "restore": _restore}[args.step](args)


if __name__ == "__main__":
    main()
