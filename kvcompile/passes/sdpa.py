"""Where scaled-dot-product attention hides in a graph, and how to read it.

Every spelling the passes accept is listed in ``SDPA_TARGETS``; arguments are read by name through ``sdpa_args``
(never by position), and ``kv_heads_source`` sees through ``repeat_kv`` (unsqueeze -> expand -> reshape) back to the
tensor with one head per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

aten = torch.ops.aten

SDPA_TARGETS = (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.clone.default,
          aten.contiguous.default)


class UnsupportedGraph(ValueError):
    """The graph has attention kvcompile cannot rewrite without changing what the model computes."""


@dataclass
class SdpaCall:
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: object
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool


def find_sdpa(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def sdpa_args(node: fx.Node) -> SdpaCall:
    """Bind an SDPA node's args and kwargs to parameter names."""
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return SdpaCall(**{name: bound[name] for name in _SDPA_PARAMS})


def module_path(node: fx.Node) -> str:
    """The dotted path of the module that issued ``node`` (for error messages), or its graph name."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else node.name


def _heads(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return int(val.shape[1]) if isinstance(val, torch.Tensor) and val.dim() == 4 else None


_RESHAPES = _VIEWS + (aten.transpose.int, aten.permute.default)


def output_projection(node: fx.Node) -> fx.Node | None:
    """The weight (a ``get_attr`` node) of the linear projection that reads attention output ``node`` through
    reshapes and transposes only (W_O), or None when the output goes anywhere else."""
    x = node
    while len(x.users) == 1:
        x = next(iter(x.users))
        if x.op == "call_function" and x.target == aten.linear.default and x.args[0] is not node:
            weight = x.args[1]
            return weight if isinstance(weight, fx.Node) and weight.op == "get_attr" else None
        if not (x.op == "call_function" and x.target in _RESHAPES):
            return None
    return None


def kv_heads_source(node: fx.Node, num_kv_heads: int) -> fx.Node | None:
    """The node holding ``node``'s keys (or values) with ``num_kv_heads`` heads, seeing through repeat_kv.

    Returns None if the tensor cannot be traced back to one with that many heads.
    """
    if _heads(node) == num_kv_heads:
        return node
    x = node
    while x.op == "call_function" and x.target in _VIEWS:
        x = x.args[0]
    if not (x.op == "call_function" and x.target == aten.expand.default):
        return None
    x = x.args[0]
    if x.op == "call_function" and x.target == aten.unsqueeze.default and x.args[1] == 2:
        src = x.args[0]
        return src if _heads(src) == num_kv_heads else None
    return None
