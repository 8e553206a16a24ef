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

Prints one table; ``--out`` also writes it as JSON. Run: ``python bench/gpu_check.py --out bench/results/gpu_check``
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kvcompile.cache import PagedKVCache
from kvcompile.kernels import reference
from kvcompile.kernels.flex import flex_paged_decode
from kvcompile.kernels.formats import FORMATS, encode_pool
from kvcompile.plan import Plan
from kvcompile.kernels.triton_compact import compact
from kvcompile.kernels.triton_decode import paged_decode


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
                err = (paged_decode(*args).float() - reference.paged_attention(*args).float()).abs().max().item()
                rows.append({"check": f"decode {dtype} G={G} window={window}", "max_err": err, "ok": err <= tol[dtype]})
                lw = torch.randn(cache.page_pos.shape, generator=gen).to(device) * 2  # weighted entries' log-weights
                err = (paged_decode(*args, log_weights=lw).float()
                       - reference.paged_attention(*args, log_weights=lw).float()).abs().max().item()
                rows.append({"check": f"decode weighted {dtype} G={G} window={window}", "max_err": err,
                             "ok": err <= tol[dtype]})
                if flex is not None and dtype == torch.bfloat16 and G == 4:
                    for weights in (None, lw) if window == 0 else (None,):
                        got = flex_paged_decode(*args, attend=flex, log_weights=weights).float()
                        err = (got - reference.paged_attention(*args, log_weights=weights).float()).abs().max().item()
                        rows.append({"check": f"flex decode{' weighted' if weights is not None else ''} bf16 "
                                     f"window={window}", "max_err": err, "ok": err <= tol[dtype]})
        cache = random_cache(2, 4, zipf_lengths(8, 300, gen).view(2, 4), 16, 128, dtype, gen, device)
        q = torch.randn(2, 16, 1, 128, generator=gen).to(device, dtype)
        # ThinK's and TQ3's pages included; SPECTRA's rows have no Triton kernel (ops reads them in PyTorch)
        for name in [n for n, f in FORMATS.items() if not f.latent] if dtype == torch.float32 else ():
            stored, empty = as_format(cache, name)
            args = (q, torch.full((2, 1), 2000, device=device), cache.k_pages, cache.v_pages, cache.page_pos,
                    cache.page_table[0], empty, 128**-0.5, 0)
            got = paged_decode(*args, stored=stored).float()
            err = (got - reference.paged_attention(*args, stored=stored).float()).abs().max().item()
            rows.append({"check": f"decode over {name} pages", "max_err": err, "ok": err <= 1e-3})
        keep_count = cache.lengths[0].long().cpu() // 3
        keep_idx = torch.zeros(*keep_count.shape, max(int(keep_count.max()), 1), dtype=torch.long)
        for (b, h), n in zip(torch.cartesian_prod(torch.arange(2), torch.arange(4)).tolist(), cache.lengths[0].flatten()):
            c = int(keep_count[b, h])
            keep_idx[b, h, :c] = torch.randperm(int(n), generator=gen)[:c].sort().values
        keep_idx, keep_count = keep_idx.to(device), keep_count.to(device)
        pools = (cache.k_pages, cache.v_pages, cache.page_pos, torch.randn(cache.page_pos.shape, device=device))
        ref = [t.clone() for t in pools]
        reference.compact(*ref, cache.page_table[0], keep_idx, keep_count)
        compact(*pools, cache.page_table[0], keep_idx, keep_count)  # with log-weights: a weighted cache's compaction
        same = all(torch.equal(a, b) for a, b in zip(ref, pools))
        rows.append({"check": f"compact {dtype}", "max_err": 0.0 if same else math.inf, "ok": same})
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
    if flex is not None:  # its block mask is rebuilt from the page table each call: timed with it, without a graph
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
    """Seconds per call of ``run`` (no graph), after warm-up."""
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--no-flex", action="store_true", help="skip the flex_attention backend (it compiles per shape)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(torch.seed() % 2**31)
    flex = None if args.no_flex else _flex()
    result = {"device": torch.cuda.get_device_name(), "checks": check_kernels(device, gen, flex),
              "decode": bench_decode(device, gen, flex)}
    for row in result["checks"]:
        print(f"{row['check']:<40} max_err={row['max_err']:.2e} {'ok' if row['ok'] else 'FAIL'}")
    decode = result["decode"]
    print(f"decode {decode['shape']}, copy bandwidth {decode['copy_GBps']:.0f} GB/s")
    for name, row in decode["formats"].items():
        print(f"  {name:<9} " + "  ".join(f"{k}={v:.4g}" for k, v in row.items()))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
    if not all(r["ok"] for r in result["checks"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
