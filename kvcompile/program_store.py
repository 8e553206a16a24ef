"""A disk cache of captured, rewritten programs, so a model is captured once per machine, not once per process.

Capturing a model (``torch.export``) takes seconds to tens of seconds; the graphs it gives never hold a weight's
value: every parameter and buffer is read from the live model by name (``get_attr``). So the cache stores the
graphs' nodes as JSON (op, target name, arguments) and any tensor a graph holds itself in safetensors, and a
later ``apply`` on a model with the same key rebuilds the graphs over the live model's weights.

Loading executes nothing stored: targets are looked up by name in ``torch.ops.aten``, ``torch.ops.kvcompile``, a
few of Python's ``operator`` functions and the passes' own functions (``streamed_linear``); anything else makes the
entry unusable (it is then captured again). The key
(``key``) covers the model's class and config, every weight's name, shape, dtype and device type, and the torch,
transformers and kvcompile versions, with a hash of kvcompile's own source: a change in any of them captures again.

Where: ``$KVCOMPILE_PROGRAM_CACHE`` if set (``0`` / ``off`` turns the cache off), else
``$KVCOMPILE_CACHE/programs``, else ``~/.cache/kvcompile/programs``; one folder per key, about 1-2 MB for a
30-layer model (the graphs, not the weights). ``apply(..., capture_cache=False)`` skips it for one call.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import operator
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import fx, nn

from . import ops  # noqa: F401  (registers torch.ops.kvcompile, which stored graphs name)
from .passes.streamed_linear import streamed_linear

FORMAT = 1
SYMBOLIC_SIZE = 2  # a loaded graph's ``meta["val"]`` is a meta tensor; its symbolic (batch, token) sizes read as 2
GRAPHS = "graphs.json"
CONSTANTS = "constants.safetensors"
_NAMESPACES = {"aten": torch.ops.aten, "kvcompile": torch.ops.kvcompile}
_FUNCTIONS = {f"kvcompile.{f.__name__}": f for f in (streamed_linear,)}  # Python functions the passes insert
_OPERATORS = frozenset({"getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pow", "eq", "ne",
                        "lt", "le", "gt", "ge", "and_", "or_"})
_SCALARS = {"dtype": torch.dtype, "device": torch.device, "layout": torch.layout, "memory_format": torch.memory_format}


def folder(setting: bool | str | os.PathLike = True) -> Path | None:
    """The cache folder ``apply``'s ``capture_cache`` names (True: the environment's or the default), or None
    when the cache is off."""
    if setting is False:
        return None
    if setting is not True:
        if not isinstance(setting, (str, os.PathLike)):
            raise TypeError(f"capture_cache must be True, False or a folder, got {type(setting).__name__}")
        return Path(setting)
    env = os.environ.get("KVCOMPILE_PROGRAM_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "false", "no") else Path(env)
    root = os.environ.get("KVCOMPILE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kvcompile") / "programs"


def key(model: nn.Module) -> str | None:
    """The cache key of ``model``'s programs, or None for a model the cache cannot identify (no transformers
    config: a plain module's graph depends on code the key cannot see)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    import transformers

    weights = [(name, tuple(t.shape), str(t.dtype), t.device.type)
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    parts = {
        "format": FORMAT, "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config.to_json_string(use_diff=False), "attn": getattr(config, "_attn_implementation", None),
        "weights": weights, "torch": torch.__version__, "transformers": transformers.__version__,
        "kvcompile": _source_hash(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def _source_hash() -> str:
    """A hash of every source file of kvcompile: a library change, even uncommitted, captures again."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def save(where: Path, graphs: dict[str, fx.GraphModule], info: dict, model: nn.Module) -> None:
    """Store ``graphs`` (over ``model``'s weights) and the JSON-able ``info`` under ``where``, atomically: a reader
    sees the whole entry or none of it."""
    from safetensors.torch import save_file

    constants: dict[str, torch.Tensor] = {}
    try:
        stored = {name: _nodes(gm, model, constants) for name, gm in graphs.items()}
    except ValueError as e:  # a graph calling something the store cannot name: it is captured every time
        warnings.warn(f"kvcompile: programs not cached ({e})", stacklevel=3)
        return
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=where.parent, prefix=".tmp-"))
    try:
        (tmp / GRAPHS).write_text(json.dumps({"format": FORMAT, "graphs": stored, "info": info}))
        save_file({k: v.detach().cpu().contiguous() for k, v in constants.items()}, str(tmp / CONSTANTS))
        os.replace(tmp, where)
    except OSError:  # another process stored the same entry first, or the disk is read-only: nothing lost
        shutil.rmtree(tmp, ignore_errors=True)


def load(where: Path, model: nn.Module) -> tuple[dict[str, fx.GraphModule], dict] | None:
    """The graphs stored under ``where`` rebuilt over ``model``'s weights, and their info; None when there is no
    usable entry (missing, from another format, or naming a target outside the allowed namespaces)."""
    from safetensors.torch import load_file

    gc_was_on = gc.isenabled()
    gc.disable()  # the load makes ~10^5 small objects and frees none: the collector's passes would cost more than it
    try:
        stored = json.loads((where / GRAPHS).read_text())
        if stored.get("format") != FORMAT:
            return None
        device = next(model.parameters()).device
        constants = {k: v.to(device) for k, v in load_file(str(where / CONSTANTS)).items()}
        graphs = {name: _graph_module(nodes, model, constants) for name, nodes in stored["graphs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    finally:
        if gc_was_on:
            gc.enable()
    return graphs, stored["info"]


# ------------------------------------------------------------------------------------------------ encoding
def _nodes(gm: fx.GraphModule, model: nn.Module, constants: dict) -> list:
    """``gm``'s nodes as JSON-able records; tensors it holds itself (not ``model``'s own parameters and buffers,
    which a load takes from the live model by name) go to ``constants`` under their attribute path."""
    records = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in constants:
            value = _attr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"cannot store attribute {node.target!r} of type {type(value).__name__}")
            if not _is_weight(model, node.target, value):
                constants[node.target] = value
        records.append([node.name, node.op, _target(node), [_encode(a) for a in node.args],
                        {k: _encode(v) for k, v in node.kwargs.items()},
                        _shape(node.meta.get("val"))])
    return records


def _shape(val) -> list | None:
    """A tensor value's sizes (None where symbolic) and dtype: what the passes read of ``meta["val"]``."""
    if not isinstance(val, torch.Tensor):
        return None
    return [[d if isinstance(d, int) else None for d in val.shape], str(val.dtype).removeprefix("torch.")]


def _target(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if getattr(target, "__module__", None) in ("operator", "_operator") and target.__name__ in _OPERATORS:
        return f"operator.{target.__name__}"
    if _FUNCTIONS.get(f"kvcompile.{getattr(target, '__name__', '')}") is target:
        return f"kvcompile.{target.__name__}"
    raise ValueError(f"cannot store a call to {target!r}")


def _encode(value):
    """JSON for an argument: a node is its name behind ``%``, a string is ``{"s": ...}`` (rare), lists stay lists,
    everything else a one-key object naming its kind. Plain scalars are themselves."""
    if isinstance(value, fx.Node):
        return "%" + value.name
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, str):
        return {"s": value}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v)] for k, v in value.items()]}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    for kind, cls in _SCALARS.items():
        if isinstance(value, cls):
            return {kind: str(value)}
    raise ValueError(f"cannot store an argument of type {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ decoding
def _graph_module(records: list, model: nn.Module, constants: dict) -> fx.GraphModule:
    graph, env, tensors = fx.Graph(), {}, {}
    for name, op, target, args, kwargs, val in records:
        args = tuple(_decode(a, env) for a in args)
        kwargs = {k: _decode(v, env) for k, v in kwargs.items()}
        if op == "placeholder":
            node = graph.placeholder(target)
        elif op == "get_attr":
            tensors[target] = constants[target] if target in constants else _attr(model, target)
            node = graph.get_attr(target)
        elif op == "call_function":
            node = graph.call_function(_resolve(target), args, kwargs)
        elif op == "output":
            graph.output(args[0])
            continue
        else:
            raise ValueError(f"cannot load a {op!r} node")
        node.name = name
        if val is not None:  # a stand-in for the traced value: symbolic sizes become SYMBOLIC_SIZE
            sizes, dtype = val
            node.meta["val"] = torch.empty([SYMBOLIC_SIZE if d is None else d for d in sizes],
                                           dtype=_dtype(dtype), device="meta")
        env[name] = node
    return fx.GraphModule(tensors, graph)  # parameters stay parameters (the model's own), other tensors buffers


def _resolve(name: str):
    space, _, rest = name.partition(".")
    if space == "operator" and rest in _OPERATORS:
        return getattr(operator, rest)
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    op, overload = rest.rsplit(".", 1)
    return getattr(getattr(_NAMESPACES[space], op), overload)


def _decode(value, env: dict):
    if isinstance(value, str):
        return env[value[1:]]
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, payload), = value.items()
    if kind == "s":
        return payload
    if kind == "tuple":
        return tuple(_decode(v, env) for v in payload)
    if kind == "dict":
        return {k: _decode(v, env) for k, v in payload}
    if kind == "slice":
        return slice(*(_decode(v, env) for v in payload))
    if kind in ("dtype", "layout", "memory_format"):
        return _torch_value(kind, payload.removeprefix("torch."))
    if kind == "device":
        return torch.device(payload)
    raise ValueError(f"unknown stored value {kind!r}")


@functools.cache
def _torch_value(kind: str, name: str):
    """``torch.<name>``, which must be a torch ``kind`` (a dtype, layout or memory format)."""
    found = getattr(torch, name)
    if not isinstance(found, _SCALARS[kind]):
        raise ValueError(f"not a torch {kind}: {name!r}")
    return found


def _dtype(name: str) -> torch.dtype:
    return _torch_value("dtype", name)


def _is_weight(model: nn.Module, path: str, value: torch.Tensor) -> bool:
    """Whether ``model.<path>`` is the very tensor ``value`` (the same storage), not a constant of the graph."""
    try:
        own = _attr(model, path)
    except AttributeError:
        return False
    return isinstance(own, torch.Tensor) and own.shape == value.shape and own.data_ptr() == value.data_ptr()


def _attr(root: nn.Module, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root
