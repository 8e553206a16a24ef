"""Ship a compressed model: ``export`` writes AOTInductor packages of the prefill and decode programs plus the cache
layout and recipe; ``load`` rebuilds a ``CompressedModel`` from them in any process (no model code, no capture).

The artifact is a folder::

    prefill.pt2, prefill_last.pt2, decode.pt2
                              AOTInductor packages: (input_ids, position_ids, q_pos, slots, *cache) -> logits
    kvcompile.json            spec (geometry, dtype, windows), per-layer scales, recipe, budget, page size

The cache stays outside the packages (its tensors are program inputs, mutated in place), so the loaded model
allocates, compresses and reports bytes exactly like the in-memory one. The kvcompile ops run through the
dispatcher, so ``load`` imports kvcompile (which registers them) before running a package.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from . import passes
from .budget import Budget
from .cache import PagedKVCache
from .recipes import Recipe
from .runtime import CompressedModel, Programs
from .spec import ModelSpec

_FORMAT = 1


def _example(cm: CompressedModel, tokens: int):
    """Inputs of the right ranks and dtypes for tracing (their values do not matter)."""
    spec, B = cm.spec, 2
    cache = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.num_q_heads, spec.head_dim, dtype=spec.dtype,
                         page_size=cm.cache.page_size, obs_window=cm.cache.obs_window, device=cm.device)
    cache.setup(B)
    cache.reserve(2 * cache.page_size)
    real = torch.ones(B, tokens, dtype=torch.bool, device=cm.device)
    ids = torch.zeros(B, tokens, dtype=torch.long, device=cm.device)
    pos = torch.arange(tokens, device=cm.device).expand(B, tokens).contiguous()
    return (ids, pos, pos.clone(), cache.slots_for(real), *[getattr(cache, n) for n in passes.CACHE_BUFFERS])


def _dynamic_shapes(decode: bool):
    batch = torch.export.Dim("batch", min=1, max=4096)
    pages = torch.export.Dim("pages", min=2, max=1 << 24)
    width = torch.export.Dim("max_pages", min=1, max=1 << 20)
    tok = {0: batch} if decode else {0: batch, 1: torch.export.Dim("tokens", min=1, max=1 << 20)}
    slots = {1: batch} if decode else {1: batch, 3: tok[1]}
    return (tok, tok, tok, slots, {0: pages}, {0: pages}, {0: pages}, {1: batch, 3: width}, {1: batch}, {1: batch})


def export(cm: CompressedModel, path, *, backend: str = "aoti") -> Path:
    """Write ``cm``'s programs and layout to the folder ``path``; returns it. ``load(path)`` reads it back.

    ``backend="aoti"`` (default) compiles with AOTInductor (CPU or CUDA, whichever device the model is on).
    ``backend="tensorrt"`` needs ``torch_tensorrt`` and a CUDA device; it has not been run yet.
    """
    if backend == "tensorrt":
        raise NotImplementedError(
            "backend='tensorrt' is not implemented yet (it needs torch_tensorrt and a CUDA device, and has never "
            "been run); use backend='aoti'"
        )
    if backend != "aoti":
        raise ValueError(f"unknown export backend {backend!r}; use 'aoti'")
    if cm.programs.captured is None:
        raise ValueError("this model was itself loaded from an artifact; export the model it came from")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for name in Programs.NAMES:
        decode = name == "decode"
        program = getattr(cm.programs, name)
        program = getattr(program, "_orig_mod", program)  # the eager graph under a torch.compile wrapper
        with torch.no_grad():
            ep = torch.export.export(program, _example(cm, 1 if decode else 8), dynamic_shapes=_dynamic_shapes(decode),
                                     strict=False)
            torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{name}.pt2"))
    spec = dataclasses.asdict(cm.spec) | {"dtype": str(cm.spec.dtype).removeprefix("torch.")}
    gen = cm.generation_config
    meta = {
        "format": _FORMAT,
        "spec": spec,
        "scales": cm.programs.scales,
        "recipe": dataclasses.asdict(cm.recipe),
        "budget": dataclasses.asdict(cm.budget),
        "page_size": cm.cache.page_size,
        "prefill_chunk": cm.prefill_chunk,
        "eos_token_id": getattr(gen, "eos_token_id", None),
    }
    (out / "kvcompile.json").write_text(json.dumps(meta, indent=1))
    return out


class _GenerationConfig:
    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


def load(path, *, device: str = "cpu") -> CompressedModel:
    """A ``CompressedModel`` from an ``export`` folder; generates the same tokens as the model that was exported."""
    folder = Path(path)
    meta_file = folder / "kvcompile.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"{folder} is not a kvcompile export (no kvcompile.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{folder}: export format {meta.get('format')!r}, this kvcompile reads format {_FORMAT}")
    spec = meta["spec"] | {"dtype": getattr(torch, meta["spec"]["dtype"]), "windows": tuple(meta["spec"]["windows"])}
    runners = [torch._inductor.aoti_load_package(str(folder / f"{n}.pt2")) for n in Programs.NAMES]
    programs = Programs(*runners, meta["scales"], captured=None)
    return CompressedModel(
        programs, ModelSpec(**spec), Recipe(**meta["recipe"]), Budget(**meta["budget"]),
        page_size=meta["page_size"], prefill_chunk=meta["prefill_chunk"],
        generation_config=_GenerationConfig(meta["eos_token_id"]), device=device,
    )
