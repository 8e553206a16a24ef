"""Ship a compressed model: ``export`` writes AOTInductor packages of the prefill and decode programs plus the cache
layout and recipe; ``load`` rebuilds a ``CompressedModel`` from them in any process (no model code, no capture).

The artifact is a folder::

    prefill.pt2, prefill_last.pt2, decode.pt2
                              AOTInductor packages: (*signature.INPUTS) -> logits
                              (``backend="tensorrt"``: ``*.ep``, exported programs holding TensorRT engines)
    kvcompile.json            spec (geometry, dtype, windows), per-layer scales, recipe, budget, page size
    latent_moments.safetensors  a latent format's calibration (``CompressedModel.latent_moments``), when it has one

The cache stays outside the packages (its tensors are program inputs, mutated in place), so the loaded model
allocates, compresses and reports bytes exactly like the in-memory one. The kvcompile ops run through the
dispatcher, so ``load`` imports kvcompile (which registers them) before running a package.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .budget import Budget
from .cache import PagedKVCache
from .methods.moments import Moments
from .model import CompressedModel
from .programs import Programs
from .recipes import Recipe
from .signature import INPUTS
from .spec import ModelSpec

_FORMAT = 7  # 2: the ring's slots are an input and its length is dynamic; 3: the format pool's tensors are inputs;
# 4: decode over the format pool calls the opaque op kvcompile::format_attention; 5: the log-weight channel is an input;
# 6: a CPU decode over fp32 pages calls the opaque op kvcompile::native_decode; 7: the attention ops take the format
# pool as one list argument
_NAMES = ("prefill", "prefill_last", "decode")
MOMENTS = "latent_moments.safetensors"
_SUFFIX = {"aoti": ".pt2", "tensorrt": ".ep"}


def _require_tensorrt(device: torch.device) -> None:
    """Fail early, naming what is missing, before anything is written."""
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError as e:
        raise ImportError("backend='tensorrt' needs torch_tensorrt (pip install torch-tensorrt); "
                          "or backend='aoti'") from e
    if device.type != "cuda":
        raise ValueError(f"backend='tensorrt' needs the model on a CUDA device; it is on {device.type}")


def _example(cm: CompressedModel, tokens: int, ring: int):
    """Inputs of the right ranks and dtypes for tracing (their values do not matter): two rows, a pool of a few
    pages, ``ring`` ring slots."""
    spec, B = cm.spec, 2
    cache = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.num_q_heads, spec.head_dim, dtype=cm.cache.dtype,
                         page_size=cm.cache.page_size, device=cm.device, page_format=cm.recipe.format,
                         weighted=cm.cache.weighted, basis=cm.cache.fmt_basis if cm.cache.fmt_basis.shape[1] else None)
    cache.setup(B)
    cache.reserve(2 * cache.page_size)
    cache.ring.resize(ring)
    step = cache.append(torch.ones(B, tokens, dtype=torch.bool, device=cm.device), observe=ring)
    ids = torch.zeros(B, tokens, dtype=torch.long, device=cm.device)
    return (ids, step.position_ids, step.q_pos, step.slots, step.ring_slots, *cache.program_tensors())


_RANGES = {"batch": (1, 4096), "tokens": (1, 1 << 20), "pages": (2, 1 << 24), "width": (2, 1 << 20),
           "ring": (0, 1 << 20), "fmt_pages": (2, 1 << 24), "fmt_width": (2, 1 << 20), "lw_pages": (2, 1 << 24),
           "anchors": (2, 1 << 20), "residuals": (0, 1 << 24)}


def _dynamic_shapes(decode: bool, formatted: bool, weighted: bool, anchored: bool):
    """``signature.INPUTS``' varying sizes as ``torch.export`` dimensions. A decode program has one token and a
    fixed ring (the recipe's decode window: its op writes the ring only when there is one); the prefill op is
    opaque, so its ring may be any length, 0 included. Without a page format the format pool is empty (static),
    without anchored rows (``cache.anchored``) their tables are, and without weighted entries the log-weight
    channel is."""
    dims = {name: torch.export.Dim(name, min=lo, max=hi) for name, (lo, hi) in _RANGES.items()}
    static = ((("tokens", "ring") if decode else ()) + (() if formatted else ("fmt_pages", "fmt_width"))
              + (() if anchored else ("anchors", "residuals")) + (() if weighted else ("lw_pages",)))
    return tuple({d: dims[n] for d, n in i.dims if n not in static} for i in INPUTS)


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
    for name in _NAMES:
        decode = name == "decode"
        program = getattr(cm.programs, name)
        program = getattr(program, "_orig_mod", program)  # the eager graph under a torch.compile wrapper
        example = _example(cm, 1 if decode else 8, cm.decode_window if decode else 2)
        file = out / f"{name}{_SUFFIX[backend]}"
        with torch.no_grad():
            shapes = _dynamic_shapes(decode, cm.recipe.format is not None, cm.cache.weighted, cm.cache.anchored)
            ep = torch.export.export(program, example, dynamic_shapes=shapes, strict=False)
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
        "scales": [layer.scale for layer in cm.programs.layers],
        "vocab_size": cm.programs.vocab_size,
        "recipe": dataclasses.asdict(cm.recipe),
        "budget": dataclasses.asdict(cm.budget),
        "page_size": cm.cache.page_size,
        "prefill_chunk": cm.prefill_chunk,
        "eos_token_id": getattr(gen, "eos_token_id", None),
        "torch": torch.__version__,
    }
    (out / "kvcompile.json").write_text(json.dumps(meta, indent=1))
    if cm.latent_moments is not None:  # a latent format's calibration: the basis its pages are stored in
        save_file({f"{i}.{part}": m.contiguous() for i, layer in enumerate(cm.latent_moments)
                   for part, m in zip(Moments._fields, layer)}, out / MOMENTS)
    return out


def _moments(file: Path) -> list[Moments]:
    """A latent format's calibration written by ``export``: per layer, its ``Moments``."""
    tensors, n = load_file(file), len(Moments._fields)
    return [Moments(*(tensors[f"{i}.{part}"] for part in Moments._fields)) for i in range(len(tensors) // n)]


class _GenerationConfig:
    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


_MANIFEST = {  # key: (type, what it must be)
    "format": (int, f"the export format, {_FORMAT}"),
    "backend": (str, f"one of {sorted(_SUFFIX)}"),
    "spec": (dict, "the model's attention geometry"),
    "scales": (list, "one softmax scale per layer"),
    "vocab_size": ((int, type(None)), "the vocabulary size"),
    "recipe": (dict, "the recipe"),
    "budget": (dict, "the budget"),
    "page_size": (int, "tokens per page"),
    "prefill_chunk": ((int, type(None)), "the prefill chunk"),
    "torch": (str, "the torch version that compiled the packages"),
}


def _manifest(folder: Path) -> dict:
    """The folder's ``kvcompile.json``, checked: present, JSON, every key of the schema with the right type, this
    format, a known backend, the same torch. Raises naming the file and the problem."""
    file = folder / "kvcompile.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} is not a kvcompile export: {file.name} is missing")
    try:
        meta = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{file} must hold a JSON object")
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{file}: export format {meta.get('format')!r}, this kvcompile reads format {_FORMAT}; "
                         "export it again")
    for key, (kind, what) in _MANIFEST.items():
        if key not in meta:
            raise ValueError(f"{file} has no {key!r} ({what}); the artifact is incomplete")
        if not isinstance(meta[key], kind):
            raise ValueError(f"{file}: {key!r} must be {what}, got {type(meta[key]).__name__}")
    if meta["backend"] not in _SUFFIX:
        raise ValueError(f"{file}: unknown backend {meta['backend']!r}")
    if meta["torch"].split("+")[0] != torch.__version__.split("+")[0]:
        raise ValueError(f"{folder} was compiled with torch {meta['torch']}, this is torch {torch.__version__}: "
                         "compiled packages are not portable across versions; export it again")
    return meta


def _program(file: Path, backend: str):
    """Load one compiled program, naming the file when it is missing or broken."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the artifact is incomplete")
    try:
        if backend == "tensorrt":
            return torch.export.load(str(file)).module()
        return torch._inductor.aoti_load_package(str(file))
    except Exception as e:  # noqa: BLE001 - any failure to read a package names the package
        raise ValueError(f"{file} is not a loadable {backend} package ({type(e).__name__}: {e})") from e


def load(path, *, device: str = "cpu") -> CompressedModel:
    """A ``CompressedModel`` from an ``export`` folder; generates the same tokens as the model that was exported.

    An artifact is code: its packages are compiled programs that run in this process, so load only folders from a
    source you trust. The default (AOTInductor) path reads no pickle; ``backend="tensorrt"`` artifacts are read
    by ``torch.export.load``, which may."""
    folder = Path(path)
    meta = _manifest(folder)
    try:
        spec = ModelSpec(**(meta["spec"] | {"dtype": getattr(torch, meta["spec"]["dtype"]),
                                            "windows": tuple(meta["spec"]["windows"]),
                                            "rotary": tuple(map(tuple, meta["spec"].get("rotary", ())))}))
        recipe, budget = Recipe(**meta["recipe"]), Budget(**meta["budget"])
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise ValueError(f"{folder / 'kvcompile.json'}: spec, recipe or budget is malformed ({e})") from e
    if len(meta["scales"]) != spec.num_layers:
        raise ValueError(f"{folder / 'kvcompile.json'}: {len(meta['scales'])} scales for {spec.num_layers} layers")
    if meta["backend"] == "tensorrt":
        _require_tensorrt(torch.device(device))
    runners = [_program(folder / f"{n}{_SUFFIX[meta['backend']]}", meta["backend"]) for n in _NAMES]
    programs = Programs(*runners, None, spec.layers(meta["scales"]), meta["vocab_size"])
    return CompressedModel(
        programs, spec, recipe, budget, page_size=meta["page_size"], prefill_chunk=meta["prefill_chunk"],
        generation_config=_GenerationConfig(meta.get("eos_token_id")), device=device,
        latent_moments=_moments(folder / MOMENTS) if (folder / MOMENTS).exists() else None,
    )
