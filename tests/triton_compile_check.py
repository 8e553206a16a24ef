"""Compile every Triton kernel variant for an H100/H200 (sm_90) without a GPU: run by
``test_triton_kernels_compile`` in a process of its own (the interpreter tests import the kernels interpreted).

Triton's interpreter runs a kernel as Python, so it accepts kernels its compiler rejects (statements after an
early ``return`` in a constexpr branch are still built by the compiler: found on a GPU, where the decode failed
to compile for every dtype; and Inductor types scalars its own way, see ``compile_only``). Here the launches go
through Triton's real front end and backend, with a stand-in driver that names the target and launches nothing;
CPU tensors stand in for device memory.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402

from kvcompile.kernels import reference  # noqa: E402
from kvcompile.kernels.formats import FORMATS, encode_pool  # noqa: E402
from kvcompile.kernels.triton_compact import compact  # noqa: E402
from kvcompile.kernels.triton_decode import paged_decode  # noqa: E402


class CompileOnly:
    """Triton's view of an sm_90 device that is never launched on."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_only():
    """Launches compile and return. Each kernel with a float scalar compiles a second time with it as fp64: Inductor
    passes a Python float to a user kernel so (a compiled decode on the H200 failed to build where the plain call
    built: ``scale`` made the running maximum fp64)."""
    driver.set_active(CompileOnly())
    launch, build = jit.JITFunction.run, jit.JITFunction._do_compile
    jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: launch(self, *a, grid=grid, warmup=True, **kw)

    def build_both(self, key, signature, *rest):
        kernel = build(self, key, signature, *rest)
        if "fp32" in signature.values():
            build(self, (key, "fp64"), {k: "fp64" if t == "fp32" else t for k, t in signature.items()}, *rest)
        return kernel

    jit.JITFunction._do_compile = build_both


def pools(dtype, B=2, Hkv=2, P=16, D=64, pages=4):
    k, v = (torch.randn(1 + B * Hkv * pages, P, D).to(dtype) for _ in range(2))
    page_pos = torch.zeros(k.shape[:2], dtype=torch.int32)
    table = torch.arange(1, 1 + B * Hkv * pages, dtype=torch.int32).view(B, Hkv, pages)
    return k, v, page_pos, table, torch.full((B, Hkv), P * pages, dtype=torch.int32)


def main():
    compile_only()
    built = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        k, v, page_pos, table, lengths = pools(dtype)
        for G in (1, 4):
            q = torch.randn(2, 2 * G, 1, 64).to(dtype)
            for log_weights in (None, torch.randn(page_pos.shape)):
                paged_decode(q, torch.full((2, 1), 100), k, v, page_pos, table, lengths, 0.125, 0,
                             log_weights=log_weights)
                built.append(f"decode {dtype} G={G} weighted={log_weights is not None}")
        compact(k, v, page_pos, torch.randn(page_pos.shape), table, torch.zeros(2, 2, 8, dtype=torch.long),
                torch.full((2, 2), 8))
        built.append(f"compact {dtype}")
    k, v, page_pos, table, lengths = pools(torch.float32)
    q = torch.randn(2, 8, 1, 64)
    for name, fmt in FORMATS.items():
        if not fmt.triton_reads:  # read in PyTorch on every device: no kernel
            continue
        kc, km = encode_pool(fmt.key, k)
        vc, vm = encode_pool(fmt.value, v)
        stored = reference.FormatPages(kc, km, vc, vm, page_pos, table, lengths)
        paged_decode(q, torch.full((2, 1), 100), k, v, page_pos, table, torch.zeros_like(lengths), 0.125, 0,
                     stored=stored)
        built.append(f"decode over {name} pages")
    print("\n".join(built))


if __name__ == "__main__":
    main()
