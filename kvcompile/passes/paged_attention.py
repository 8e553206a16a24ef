"""Replace every scaled-dot-product-attention node with a kvcompile attention op bound to its layer."""

from __future__ import annotations

import torch
from torch import fx

from .. import ops  # noqa: F401  (registers torch.ops.kvcompile)
from ..signature import ADDED, FORMAT_POOL
from ..spec import ModelSpec
from .base import GraphPass
from .sdpa import UnsupportedGraph, find_sdpa, kv_heads_source, module_path, output_projection, sdpa_args


class InsertPagedAttention(GraphPass):
    """Route every SDPA node through the paged cache, whose tensors become graph inputs.

    Adds graph inputs after the existing ones, named and ordered as ``signature.INPUTS`` declares (the step's
    positions, pool rows and ring slots, then the cache tensors, which the ops mutate in place), so the same program
    runs eagerly, compiled or exported; the format pool's tensors reach each op as one list. ``scales`` records each
    layer's softmax scale, ``output_weights`` the attribute path of its output projection W_O (None where the graph
    has none in reach).
    Keys and values are taken before ``repeat_kv``, so the op sees one head per KV head. The model's own
    attention mask is dropped: the op rebuilds causal, padding and sliding-window visibility from stored positions.
    That is exact for a transformers causal LM (whose mask is exactly that); any other model must call SDPA with
    ``is_causal=True`` and no mask, else this raises.
    ``packed`` (decode only): call ``decode_attention_packed``, which assumes a packed cache
    (``PagedKVCache.packed``) and reads it without gathering.
    """

    def __init__(self, spec: ModelSpec, decode: bool, packed: bool = False):
        self.spec, self.decode, self.packed = spec, decode, packed

    def __call__(self, gm: fx.GraphModule) -> None:
        graph, spec = gm.graph, self.spec
        nodes = find_sdpa(graph)
        if not nodes:
            raise UnsupportedGraph(
                "no scaled_dot_product_attention call found in the captured graph; load a transformers model with "
                "attn_implementation='sdpa', or call torch.nn.functional.scaled_dot_product_attention in your module"
            )
        if len(nodes) != spec.num_layers:
            raise UnsupportedGraph(
                f"found {len(nodes)} attention nodes for {spec.num_layers} attention layers: "
                + ", ".join(module_path(n) for n in nodes)
            )
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_input):
            added = dict(zip(ADDED, [graph.placeholder(f"kvc_{name}") for name in reversed(ADDED)][::-1]))
        bundle = {i.name for i in FORMAT_POOL}  # the format pool reaches the op as one list argument
        args = [node for name, node in added.items() if name not in bundle] + [[added[i.name] for i in FORMAT_POOL]]
        kvc = torch.ops.kvcompile
        op = ((kvc.decode_attention_packed if self.packed else kvc.decode_attention) if self.decode
              else kvc.prefill_attention)
        op = op.default
        self.scales, self.output_weights = [], []
        for layer, node in enumerate(nodes):
            call = sdpa_args(node)
            self._check_semantics(node, call)
            k = kv_heads_source(call.key, spec.num_kv_heads)
            v = kv_heads_source(call.value, spec.num_kv_heads)
            if k is None or v is None:
                raise UnsupportedGraph(
                    f"cannot trace the keys/values of {module_path(node)} back to {spec.num_kv_heads} KV heads "
                    f"(node: {node.format_node()})"
                )
            scale = call.scale if call.scale is not None else spec.head_dim**-0.5
            self.scales.append(float(scale))
            with graph.inserting_before(node):
                new = graph.call_function(
                    op, (call.query, k, v, *args),
                    {"layer": layer, "scale": float(scale), "window": spec.windows[layer]},
                )
            new.meta = dict(node.meta)
            new.meta["kvc.layer"] = layer
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            weight = output_projection(new)
            self.output_weights.append(None if weight is None else weight.target)
        self.matched = len(nodes)

    def _check_semantics(self, node: fx.Node, call) -> None:
        if call.dropout_p not in (0, 0.0):
            raise UnsupportedGraph(f"attention with dropout_p={call.dropout_p} at {module_path(node)}; "
                                   "call model.eval()")
        if not self.spec.hf_causal_lm and (call.attn_mask is not None or not call.is_causal):
            raise UnsupportedGraph(
                f"{module_path(node)} calls scaled_dot_product_attention with an explicit mask or is_causal=False "
                f"({node.format_node()}); kvcompile only rewrites causal attention (is_causal=True, attn_mask=None)"
            )


class DropDeadMaskCode(GraphPass):
    """Erase export's tensor-metadata asserts, then dead code: the model's mask building has no users left."""

    def __call__(self, gm: fx.GraphModule) -> None:
        asserts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
        for n in asserts:
            gm.graph.erase_node(n)
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        self.matched = len(asserts) + before - len(gm.graph.nodes)
