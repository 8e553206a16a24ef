"""Ship a compressed model: ``export`` writes AOTInductor packages of the prefill and decode programs plus the cache
layout and recipe; ``load`` rebuilds a ``CompressedModel`` from them in any process (no model code, no capture).

The artifact is a folder::

    prefill.pt2, prefill_last.pt2, decode.pt2
                              AOTInductor packages: (input_ids, position_ids, q_pos, slots, *cache) -> logits
                              (``backend="tensorrt"``: ``*.ep``, exported programs holding TensorRT engines)
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
_SUFFIX = {"aoti": ".pt2", "tensorrt": ".ep"}


def _require_tensorrt(device: torch.device) -> None:
    """Fail early, naming what is missing, before anything is written."""
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError as e:
        raise ImportError("backend='tensorrt' needs torch_tensorrt (pip install torch-tensorrt); use backend='aoti'") from e
    if device.type != "cuda":
        raise ValueError(f"backend='tensorrt' needs the model on a CUDA device; it is on {device.type}")


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
    ``backend="tensorrt"`` compiles with ``torch_tensorrt`` (needs it installed and the model on CUDA); TensorRT
    builds engines for the dense layers and leaves the kvcompile ops to PyTorch. It has never been run (no GPU
    was available to the project yet).
    """
    if backend not in _SUFFIX:
        raise ValueError(f"unknown export backend {backend!r}; use one of {sorted(_SUFFIX)}")
    if cm.programs.captured is None:
        raise ValueError("this model was itself loaded from an artifact; export the model it came from")
    if backend == "tensorrt":
        _require_tensorrt(cm.device)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for name in Programs.NAMES:
        decode = name == "decode"
        program = getattr(cm.programs, name)
        program = getattr(program, "_orig_mod", program)  # the eager graph under a torch.compile wrapper
        example = _example(cm, 1 if decode else 8)
        file = out / f"{name}{_SUFFIX[backend]}"
        with torch.no_grad():
            ep = torch.export.export(program, example, dynamic_shapes=_dynamic_shapes(decode), strict=False)
            if backend == "aoti":
                torch._inductor.aoti_compile_and_package(ep, package_path=str(file))
            else:
                import torch_tensorrt

                engine = torch_tensorrt.dynamo.compile(ep, arg_inputs=list(example), min_block_size=1)
                torch_tensorrt.save(engine, str(file), output_format="exported_program", arg_inputs=list(example))
    spec = dataclasses.asdict(cm.spec) | {"dtype": str(cm.spec.dtype).removeprefix("torch.")}
    gen = cm.generation_config
    meta = {
        "format": _FORMAT,
        "backend": backend,
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
    backend = meta.get("backend", "aoti")
    if backend == "tensorrt":
        _require_tensorrt(torch.device(device))
        runners = [torch.export.load(str(folder / f"{n}.ep")).module() for n in Programs.NAMES]
    else:
        runners = [torch._inductor.aoti_load_package(str(folder / f"{n}.pt2")) for n in Programs.NAMES]
    programs = Programs(*runners, meta["scales"], captured=None)
    return CompressedModel(
        programs, ModelSpec(**spec), Recipe(**meta["recipe"]), Budget(**meta["budget"]),
        page_size=meta["page_size"], prefill_chunk=meta["prefill_chunk"],
        generation_config=_GenerationConfig(meta["eos_token_id"]), device=device,
    )
