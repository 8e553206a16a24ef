"""GPU check, one script, well under 8 minutes on one GPU: kernel correctness, then decode bandwidth.

1. Correctness of the Triton decode and compaction kernels against the PyTorch reference on fresh random inputs
   (fp32 / fp16 / bf16, GQA 1/4/8, lengths 0, 1, P, P+1 and Zipf-skewed, shuffled pages, a sliding window, and
   weighted entries: random log-weights, decoded and compacted).
   The same decode over format pages (every page format of ``kernels.formats``, decoded in the kernel) against
   the reference over the same pages.
2. The decode kernel on an 8B-like shape (batch 8, 8 KV heads, G = 4, head dim 128, bf16, Zipf per-head lengths
   averaging 4k): achieved GB/s = bytes of kept K/V (+ page ids) / kernel time, against the device's measured
   copy bandwidth; and the step time against the bytes-over-bandwidth floor. Then the same tokens stored as
   fp8, int8 and int4 pages: step time and the bytes it reads, against the bf16 pages.
3. The flex_attention backend (``KVCOMPILE_DECODE_BACKEND=flex``: ``kernels.flex`` compiled by Inductor, its Triton
   template here): bf16 against the reference (plain, sliding window, weighted entries), then its step time on the
   shape of 2, block mask included, against the Triton kernel's. ``--no-flex`` skips it (each shape compiles).
4. The library end to end (``model``): SmolLM2-135M's shape with random weights (nothing is downloaded). fp32,
   budget 1.0, eager and compiled, against transformers' own decode on the same tokens (logits); then bf16 decode
   ms/step at 4k context, batch 1 and 4: transformers (dynamic cache; StaticCache with a compiled decode in a CUDA
   graph) against kvcompile (full; snapkv and adakv-snapkv at 0.25; eager and compiled, the compiled decode in a
   CUDA graph), each against its floor (weight + KV bytes read over the copy bandwidth).

Each section runs on its own (``--sections``): one that fails prints its traceback and the rest still run; every
result is printed as it comes and written as JSON after each section (``bench/results/gpu_check/gpu_check.json``,
or ``--out``), its record naming the GPU.
Run: ``python bench/gpu_check.py``
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
from record import Results

import kvcompile
from kvcompile.cache import PagedKVCache
from kvcompile.kernels import reference
from kvcompile.kernels.flex import flex_paged_decode
from kvcompile.kernels.formats import FORMATS, encode_pool
from kvcompile.kernels.triton_compact import compact
from kvcompile.kernels.triton_decode import paged_decode
from kvcompile.plan import Plan


def zipf_lengths(n: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    w = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
    w = w[torch.randperm(n, generator=gen)]
    return (w / w.mean() * mean).round().long().clamp_min(0)


def random_cache(B, Hkv, lengths, P, D, dtype, gen, device):
    """A cache of one layer whose heads hold ``lengths`` [B, Hkv] random tokens on shuffled pages."""
    cache = PagedKVCache(1, Hkv, Hkv, D, dtype=dtype, page_size=P, device=device)
    cache.setup(B)
    n = int(lengths.max())
    cache.reserve(n)
    owned = cache.page_table > 0
    perm = torch.randperm(int(owned.sum()), generator=gen).to(device)
    cache.page_table[owned] = cache.page_table[owned][perm]  # kernel input: the heads' pages scattered in the pool
    k = torch.randn(B, Hkv, n, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, n, D, generator=gen).to(device, dtype)
    step = cache.append(torch.ones(B, n, dtype=torch.bool, device=device))
    reference.write_tokens(cache.k_pages, cache.v_pages, cache.page_pos, k, v, step.q_pos, step.slots[0])
    keep = torch.arange(n, device=device).expand(1, B, Hkv, n)
    cache.keep(Plan(keep, lengths[None].to(device)), shrink=False)
    return cache


def as_format(cache, name):
    """The cache's model-dtype pages (one layer) re-stored as a format pool of ``name`` (``FormatPages``), and
    the lengths left in the model-dtype pool (none)."""
    fmt = FORMATS[name]
    kc, km = encode_pool(fmt.key, cache.k_pages.float())
    vc, vm = encode_pool(fmt.value, cache.v_pages.float())
    stored = reference.FormatPages(kc, km, vc, vm, cache.page_pos, cache.page_table[0], cache.lengths[0])
    return stored, torch.zeros_like(cache.lengths[0])


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def compare(rows, name, run, tol):
    """Append the check ``name``: the largest difference of ``run()``'s (got, expected) pair, within ``tol``, and
    where it is (``at``: its index); an exception fails this check only (its traceback printed)."""
    at = None
    try:
        got, expected = run()
        diff = (got.float() - expected.float()).abs()
        err = diff.max().item()
        at = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)] if diff.numel() else None
    except Exception:
        traceback.print_exc()
        err = math.inf
    rows.append({"check": name, "max_err": err, "ok": err <= tol, "at": at})


def check_kernels(device, gen, flex):
    rows = []
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    for dtype in tol:
        for G in (1, 4, 8):
            B, Hkv, P, D = 2, 4, 16, 128
            lengths = torch.tensor([[0, 1, P, P + 1], [3 * P + 5, 200, 77, 1000]])
            for window in (0, 100):
                cache = random_cache(B, Hkv, lengths, P, D, dtype, gen, device)
                q = torch.randn(B, Hkv * G, 1, D, generator=gen).to(device, dtype)
                qp = torch.full((B, 1), 1000, device=device)
                args = (q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0], cache.lengths[0],
                        D**-0.5, window)
                lw = torch.randn(cache.page_pos.shape, generator=gen).to(device) * 2  # weighted entries' log-weights
                for weights in (None, lw):
                    compare(rows, f"decode{' weighted' if weights is not None else ''} {dtype} G={G} window={window}",
                            lambda w=weights: (paged_decode(*args, log_weights=w),
                                               reference.paged_attention(*args, log_weights=w)), tol[dtype])
                if flex is not None and dtype == torch.bfloat16 and G == 4:
                    for weights in (None, lw) if window == 0 else (None,):
                        compare(rows, f"flex decode{' weighted' if weights is not None else ''} bf16 window={window}",
                                lambda w=weights: (flex_paged_decode(*args, attend=flex, log_weights=w),
                                                   reference.paged_attention(*args, log_weights=w)), tol[dtype])
        cache = random_cache(2, 4, zipf_lengths(8, 300, gen).view(2, 4), 16, 128, dtype, gen, device)
        q = torch.randn(2, 16, 1, 128, generator=gen).to(device, dtype)
        # every format whose codecs have a Triton layout (the rest are read in PyTorch)
        for name in [n for n, f in FORMATS.items() if f.triton_reads] if dtype == torch.float32 else ():
            stored, empty = as_format(cache, name)
            args = (q, torch.full((2, 1), 2000, device=device), cache.k_pages, cache.v_pages, cache.page_pos,
                    cache.page_table[0], empty, 128**-0.5, 0)
            compare(rows, f"decode over {name} pages", lambda a=args, s=stored: (
                paged_decode(*a, stored=s), reference.paged_attention(*a, stored=s)), 1e-3)
        keep_count = cache.lengths[0].long().cpu() // 3
        keep_idx = torch.zeros(*keep_count.shape, max(int(keep_count.max()), 1), dtype=torch.long)
        heads = torch.cartesian_prod(torch.arange(2), torch.arange(4)).tolist()
        for (b, h), n in zip(heads, cache.lengths[0].flatten()):
            c = int(keep_count[b, h])
            keep_idx[b, h, :c] = torch.randperm(int(n), generator=gen)[:c].sort().values
        keep_idx, keep_count = keep_idx.to(device), keep_count.to(device)
        pools = (cache.k_pages, cache.v_pages, cache.page_pos, torch.randn(cache.page_pos.shape, device=device))

        def compacted(pools=pools, table=cache.page_table[0], keep_idx=keep_idx, keep_count=keep_count):
            ref = [t.clone() for t in pools]
            reference.compact(*ref, table, keep_idx, keep_count)
            compact(*pools, table, keep_idx, keep_count)  # with log-weights: a weighted cache's compaction
            return torch.cat([t.flatten().float() for t in pools]), torch.cat([t.flatten().float() for t in ref])

        compare(rows, f"compact {dtype}", compacted, 0.0)
    return rows


def bench_decode(device, gen, flex):
    B, Hkv, G, D, P, mean = 8, 8, 4, 128, 16, 4096
    lengths = zipf_lengths(B * Hkv, mean, gen).view(B, Hkv)
    cache = random_cache(B, Hkv, lengths, P, D, torch.bfloat16, gen, device)
    q = torch.randn(B, Hkv * G, 1, D, generator=gen).to(device, torch.bfloat16)
    qp = torch.full((B, 1), int(lengths.max()), device=device)
    out = torch.empty_like(q)
    tokens = int(lengths.sum())
    copy_bw = _copy_bandwidth(device)
    rows = {}
    for name in ("bf16", "fp8", "int8", "int4", "kivi2"):
        stored, held = (None, cache.lengths[0]) if name == "bf16" else as_format(cache, name)
        args = (q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0], held, D**-0.5, 0)
        t = _graph_time(lambda: paged_decode(*args, out=out, stored=stored))
        row_bytes = 2 * D * 2 if stored is None else FORMATS[name].token_bytes(D, P)
        kv_bytes = tokens * (row_bytes + 4)  # K + V as stored (scales included), page_pos int32
        rows[name] = {"decode_us": t * 1e6, "kv_bytes": kv_bytes, "achieved_GBps": kv_bytes / t / 1e9,
                      "fraction_of_copy_bw": kv_bytes / t / copy_bw, "floor_us": kv_bytes / copy_bw * 1e6}
    if flex is not None:  # a BlockMask is made each call (its page-table part is kept): timed with it, no graph
        args = (q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0], cache.lengths[0], D**-0.5, 0)
        t = _event_time(lambda: flex_paged_decode(*args, attend=flex))
        kv_bytes = tokens * (2 * D * 2 + 4)
        rows["bf16 flex"] = {"decode_us": t * 1e6, "kv_bytes": kv_bytes, "achieved_GBps": kv_bytes / t / 1e9,
                             "fraction_of_copy_bw": kv_bytes / t / copy_bw, "floor_us": kv_bytes / copy_bw * 1e6}
    base = rows["bf16"]["decode_us"]
    for row in rows.values():
        row["speedup_vs_bf16"] = base / row["decode_us"]
    return {"shape": f"B={B} Hkv={Hkv} G={G} D={D}, mean len {mean} (zipf)", "copy_GBps": copy_bw / 1e9,
            "formats": rows}


def _graph_time(run) -> float:
    """Seconds per call of ``run`` replayed in a CUDA graph."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 100 / 1e3


def _event_time(run) -> float:
    """Seconds per call of ``run`` (no graph), after warm-up: on one stream the events also count the host's time
    between launches, so an eager step's Python is in it, as a user sees it."""
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / 1e3


def _copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    buf = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(buf)
    end.record()
    torch.cuda.synchronize()
    return 2 * buf.numel() * 20 / (start.elapsed_time(end) / 1e3)


def smollm2_shape(device, dtype):
    """A Llama with SmolLM2-135M-Instruct's configuration and random weights (sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, dtype).eval()


@torch.no_grad()
def check_model(device, gen):
    """kvcompile at budget 1.0 (eager, compiled) against transformers' DynamicCache decode on the same tokens."""
    model = smollm2_shape(device, torch.float32)
    ids = torch.randint(100, 40000, (2, 300), generator=gen).to(device)
    out = model(input_ids=ids, use_cache=True)
    cache, ref = out.past_key_values, [out.logits[:, -1:]]
    tokens = [ref[-1].argmax(-1)]
    for _ in range(8):
        out = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
        ref.append(out.logits)
        tokens.append(out.logits.argmax(-1))
    scale = max(r.abs().max().item() for r in ref)
    rows = []
    for compiled in (False, True):
        cm = kvcompile.apply(model, budget=1.0, recipe="full", compile=compiled)
        got = [cm.prefill(ids, logits="last")] + [cm.decode(t) for t in tokens[:-1]]
        err = max((g.float() - r).abs().max().item() for g, r in zip(got, ref)) / scale
        rows.append({"check": f"model fp32 budget 1.0 {'compiled' if compiled else 'eager'} vs transformers",
                     "max_err": err, "ok": err <= 1e-3})
    return rows


@torch.no_grad()
def bench_model(device, gen, copy_bw, shapes=((1, 4096), (4, 4096))):
    """bf16 decode ms/step of transformers and kvcompile on SmolLM2's shape at 4k context, batch 1 and 4."""
    from transformers import StaticCache

    from kvcompile.eval.sweep import grid, shared_base

    model = smollm2_shape(device, torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    recipes = [("full", 1.0), ("snapkv", 0.25), ("adakv-snapkv", 0.25)]
    base = shared_base(kvcompile.apply(model, budget=1.0, recipe="full"), grid(["snapkv", "adakv-snapkv"], [0.25]))
    cells = []
    for batch, T in shapes:
        ids = torch.randint(100, 40000, (batch, T), generator=gen).to(device)
        full_kv = 2 * model.config.num_hidden_layers * batch * 3 * 64 * T * 2
        steps = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        hf_prefill = time.perf_counter() - t0
        state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

        def hf_step(state=state):
            o = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
            state["token"] = o.logits[:, -1:].argmax(-1)

        steps["hf dynamic"] = (hf_step, full_kv)
        static = StaticCache(config=model.config, max_cache_len=T + 64)
        out = model(input_ids=ids, past_key_values=static, use_cache=True,
                    cache_position=torch.arange(T, device=device), logits_to_keep=1)
        forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode="reduce-overhead")
        sstate = {"token": out.logits[:, -1:].argmax(-1), "pos": torch.tensor([T], device=device)}

        def hf_static_step(s=sstate, cache=static):
            o = forward(input_ids=s["token"], past_key_values=cache, use_cache=True, cache_position=s["pos"])
            s["token"] = o.logits[:, -1:].argmax(-1).clone()
            s["pos"] = s["pos"] + 1  # wraps nothing: 23 steps stay inside the 64 spare slots

        steps["hf static compiled"] = (hf_static_step, full_kv)
        base.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = base.prefill(ids, compress=False, logits="last")
        torch.cuda.synchronize()
        kv_prefill = time.perf_counter() - t0
        token = logits[:, -1:].argmax(-1)
        for recipe, budget in recipes:
            for compiled in (False, True):
                if batch == 1 and recipe != "full":
                    continue
                cm = base.fork(recipe, budget, compile=compiled)
                cm.compress()
                cm.cache.reserve(64)
                kstate = {"token": token}

                def kv_step(cm=cm, s=kstate):
                    s["token"] = cm.decode(s["token"])[:, -1].argmax(-1, keepdim=True)

                steps[f"kv {recipe} {budget}{' compiled' if compiled else ''}"] = (
                    kv_step, cm.cache_stats()["bytes_held"])
        for name, (step, kv_bytes) in steps.items():
            try:
                t = _event_time(step)
            except Exception as e:  # one variant's failure is a row, not the end of the section
                cells.append({"batch": batch, "context": T, "variant": name, "error": repr(e)[:300]})
                traceback.print_exc()
                continue
            floor = (weight_bytes + kv_bytes) / copy_bw
            cells.append({"batch": batch, "context": T, "variant": name, "ms": t * 1e3, "kv_bytes": kv_bytes,
                          "floor_ms": floor * 1e3, "x_floor": t / floor,
                          "prefill_s": hf_prefill if name.startswith("hf") else kv_prefill})
            print(json.dumps(cells[-1]), flush=True)
    skips = dict(torch._dynamo.utils.counters.get("inductor", {}))
    return {"weight_bytes": weight_bytes, "copy_GBps": copy_bw / 1e9, "cells": cells,
            "inductor_counters": {k: v for k, v in skips.items() if "cudagraph" in k}}


SECTIONS = ("kernels", "decode", "model")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="path stem of the JSON (default bench/results/gpu_check/gpu_check)")
    p.add_argument("--no-flex", action="store_true", help="skip the flex_attention backend (it compiles per shape)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    out = Results("gpu_check", args.out)
    seed = torch.seed() % 2**31
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, seed {seed}", flush=True)
    flex = None if args.no_flex else _flex()
    result, failed = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": seed}, []

    def section(name, run):
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as e:
            traceback.print_exc()
            result[name], _ = {"error": repr(e)[:2000]}, failed.append(name)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        out.json(result)

    chosen = args.sections.split(",")
    if "kernels" in chosen:
        section("checks", lambda: check_kernels(device, gen, flex))
        for row in result["checks"] if isinstance(result["checks"], list) else ():
            verdict = 'ok' if row['ok'] else f"FAIL at {row['at']}"
            print(f"{row['check']:<40} max_err={row['max_err']:.2e} {verdict}")
    if "decode" in chosen:
        section("decode", lambda: bench_decode(device, gen, flex))
        decode = result["decode"]
        if "formats" in decode:
            print(f"decode {decode['shape']}, copy bandwidth {decode['copy_GBps']:.0f} GB/s")
            for name, row in decode["formats"].items():
                print(f"  {name:<9} " + "  ".join(f"{k}={v:.4g}" for k, v in row.items()))
    if "model" in chosen:
        section("model_checks", lambda: check_model(device, gen))
        for row in result["model_checks"] if isinstance(result["model_checks"], list) else ():
            print(f"{row['check']:<40} max_err={row['max_err']:.2e} {'ok' if row['ok'] else 'FAIL'}")
        section("model", lambda: bench_model(device, gen, _copy_bandwidth(device)))
    checks = [r for key in ("checks", "model_checks") if isinstance(result.get(key), list) for r in result[key]]
    if failed or not all(r["ok"] for r in checks):
        raise SystemExit(f"failed: sections {failed}, checks {[r['check'] for r in checks if not r['ok']]}")


if __name__ == "__main__":
    main()
