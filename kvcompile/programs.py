"""The programs a ``CompressedModel`` runs: the captured graph rewritten once into a prefill and a decode program
(``passes.rewrite``), compiled on request, and called through one declared convention (``signature``).

One ``Programs`` serves every recipe and budget of a captured model: re-targeting (``kvcompile.apply`` on a
``CompressedModel``) and ``fork`` share it, so nothing is rewritten twice, and each compiled variant is made once
per backend. Compiled programs mark their varying sizes dynamic at every call (``_mark_dynamic``): a decode
program compiles once for one row and once for more, a prefill program about once, whatever the prompt lengths,
the generated tokens and the decode-time evictions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, fx, nn

from . import passes, program_store
from .cache import PagedKVCache, Step
from .capture import capture
from .signature import INPUTS
from .spec import LayerSpec, ModelSpec


@dataclass
class Programs:
    """``prefill`` / ``prefill_last`` / ``decode`` / ``decode_packed``: ``forward(*signature.INPUTS) -> logits``
    (eager FX graphs, their compiled versions, or loaded AOTInductor packages). ``prefill_last`` returns only the
    last position's logits (what generation needs); ``decode_packed`` reads a packed cache (``PagedKVCache.packed``)
    in place instead of gathering it (None: ``decode`` serves every layout, as in an exported artifact).
    ``layers``: one ``LayerSpec`` per layer; ``vocab_size``: rows of the token embedding (None: unknown);
    ``captured``: the captured model graph (None for a loaded artifact); ``compiled``: the backend, if any;
    ``weights``: (dtype, device) of the weights when they were captured (the graph bakes them in); ``info``: what
    the attention pass found (scales, output projections, vocabulary size); ``store``: the ``program_store`` setting
    they were made with (a re-capture after ``.to()`` uses it too); ``from_store``: rebuilt from it, not captured."""

    prefill: Callable
    prefill_last: Callable
    decode: Callable
    decode_packed: Callable | None
    layers: tuple[LayerSpec, ...]
    vocab_size: int | None = None
    captured: fx.GraphModule | None = None
    compiled: object = None
    weights: tuple | None = None
    info: dict | None = field(default=None, repr=False)
    store: bool | str = field(default=True, repr=False)
    from_store: bool = False
    _variants: dict = field(default_factory=dict, repr=False)
    _eager_runs: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: nn.Module, spec: ModelSpec, store: bool | str = True) -> Programs:
        """Capture ``model`` (``capture.capture``) and rewrite it, or rebuild both from the disk cache
        (``program_store``; ``store``: True for the default folder, a folder, or False for none). The graph bakes in
        the weights' dtype and device (the model's own casts), so a model moved to another one is captured again."""
        where = program_store.folder(store)
        key = program_store.key(model) if where is not None else None
        entry = where / key if key is not None else None
        found = program_store.load(entry, model) if entry is not None else None
        if found is not None:
            programs = cls._assemble(*found, spec)
            programs.from_store = True
        else:
            programs = cls.rewrite(capture(model, spec), spec)
            if entry is not None:
                program_store.save(entry, programs.graphs(), programs.info, model)
        programs.store = store
        return programs

    @classmethod
    def rewrite(cls, captured: fx.GraphModule, spec: ModelSpec, stream_weights: bool | None = None) -> Programs:
        """The four eager programs of ``captured``; ``stream_weights``: decode's projections as ``streamed_linear``
        (default: on CPU, where it is measured to be faster)."""
        cuda = next(captured.parameters()).device.type == "cuda"
        stream = not cuda if stream_weights is None else stream_weights
        prefill, found = passes.rewrite(captured, spec, decode=False)
        prefill_last, _ = passes.rewrite(captured, spec, decode=False, last_logits=True)
        decode, _ = passes.rewrite(captured, spec, decode=True, stream_weights=stream)
        decode_packed, _ = passes.rewrite(captured, spec, decode=True, packed=True, stream_weights=stream)
        graphs = dict(captured=captured, prefill=prefill, prefill_last=prefill_last, decode=decode,
                      decode_packed=decode_packed)
        info = {"scales": list(found.scales), "output_weights": list(found.output_weights),
                "vocab_size": _vocab_size(captured)}
        return cls._assemble(graphs, info, spec)

    @classmethod
    def _assemble(cls, graphs: dict[str, fx.GraphModule], info: dict, spec: ModelSpec) -> Programs:
        """Programs over the captured graph and its four rewrites (``info``: what the attention pass found)."""
        captured = graphs["captured"]
        weight = next(captured.parameters())
        w_o = [{} if t is None else {"o_proj": captured.get_parameter(t)} for t in info["output_weights"]]
        programs = cls(graphs["prefill"], graphs["prefill_last"], graphs["decode"], graphs["decode_packed"],
                       spec.layers(info["scales"], w_o), info["vocab_size"], captured,
                       weights=(weight.dtype, weight.device), info=info)
        programs._variants[None] = programs  # every variant shares this table: compile(False) gives the eager ones
        return programs

    def graphs(self) -> dict[str, fx.GraphModule]:
        """The eager graphs: the captured model and its four rewrites (what ``program_store`` saves)."""
        eager = self._variants[None]
        return dict(captured=eager.captured, prefill=eager.prefill, prefill_last=eager.prefill_last,
                    decode=eager.decode, decode_packed=eager.decode_packed)

    def compile(self, backend, page_format: str | None = None) -> Programs:
        """These programs through ``torch.compile`` with ``backend`` (``True``: Inductor), made once per backend and
        page format (``for_format``).

        Prefill: dynamic shapes. Decode: static shapes except what ``_mark_dynamic`` marks at each call; in a CUDA
        graph on CUDA (mode="reduce-overhead", not yet measured on a GPU: docs/results.md)."""
        if not backend:
            return self._variants.get(None, self)
        if self.captured is None:
            raise ValueError("these programs were loaded from an artifact: they are compiled already")
        backend = "inductor" if backend is True else backend
        key = (backend if isinstance(backend, str) else id(backend), page_format)
        if key not in self._variants:
            eager = self._variants[None]
            cuda = next(eager.captured.parameters()).device.type == "cuda"
            mode = "reduce-overhead" if cuda and backend == "inductor" else None
            # Dynamo keeps compiled code, and counts recompiles, per code object: each variant compiles its own
            # copy of the graphs (the same weights, a new ``forward``), so variants never share a recompile limit
            own = lambda gm: fx.GraphModule(gm, gm.graph)  # noqa: E731
            prefill, prefill_last = (torch.compile(own(p), backend=backend, fullgraph=True, dynamic=True)
                                     for p in (eager.prefill, eager.prefill_last))
            decode, decode_packed = (torch.compile(own(p), backend=backend, fullgraph=True, dynamic=False, mode=mode)
                                     for p in (eager.decode, eager.decode_packed))
            self._variants[key] = replace(eager, prefill=prefill, prefill_last=prefill_last, decode=decode,
                                          decode_packed=decode_packed, compiled=backend)
        return self._variants[key]

    def for_format(self, page_format: str | None) -> Programs:
        """The variant of these programs that serves caches in ``page_format``. Compiled code specialises on a
        format's code widths and dtypes, so each format gets its own compiled functions: sharing them, the formats
        of one process (a sweep's forks) would pile recompiles onto one function until Dynamo's recompile limit."""
        if not self.compiled or self.captured is None:
            return self
        return self.compile(self.compiled, page_format)

    def run(self, name: str, input_ids: Tensor, step: Step, cache: PagedKVCache) -> Tensor:
        """Call program ``name`` ("prefill", "prefill_last" or "decode") on a step: the packed decode where the
        cache's layout allows it."""
        if name == "decode" and self.decode_packed is not None and cache.packed():
            name = "decode_packed"
        # a fresh tensor: marks never stick to the caller's
        ids = input_ids.clone(memory_format=torch.contiguous_format)
        args = (ids, step.position_ids, step.q_pos, step.slots, step.ring_slots, *cache.program_tensors())
        if self.compiled is None:
            with torch.no_grad():
                return self._eager(name)(*args)
        _mark_dynamic(args, decode=name.startswith("decode"))
        with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(recompile_limit=SHAPE_CLASSES):
            return getattr(self, name)(*args)

    def _eager(self, name: str) -> Callable:
        """Program ``name`` as an eager run calls it: a copy whose ops are plain calls (``passes.for_eager_run``),
        made once; the program itself stays as it was, for compiling, saving and exporting."""
        program = getattr(self, name)
        if not isinstance(program, fx.GraphModule):  # a loaded artifact's compiled package: called as it is
            return program
        if name not in self._eager_runs:
            self._eager_runs[name] = passes.for_eager_run(program)
        return self._eager_runs[name]


# Compiled variants a program may keep. Dynamo specialises a size of 0 or 1 wherever it meets one, and a cache's
# sizes meet them by design: one row or more, no observation ring or one, no weighted pages or some, strides that
# follow. A process that serves many recipes and batch sizes meets more than Dynamo's default of 8 (the ninth was a
# hard error under fullgraph: bench/soak.py --compiled, docs/results.md).
SHAPE_CLASSES = 64


def _mark_dynamic(args, decode: bool) -> None:
    """Mark the sizes a compiled program must not specialise on. A prefill's step inputs (fresh tensors at every
    call, ``input_ids`` cloned) get unbacked batch and token sizes, so no length or batch size, 1 included,
    recompiles it. Every other varying size is marked dynamic where it is 2 or more (dynamo specialises 0 and 1;
    the cache keeps the page table at least ``cache.MIN_WIDTH`` wide): a decode program then compiles once for one
    row and once for more. Duck sizing is off around the call, so sizes that happen to be equal stay separate."""
    for tensor, spec in zip(args, INPUTS):
        for dim, name in spec.dims:
            if decode and name == "tokens":
                continue
            if not decode and spec.source != "cache" and name in ("batch", "tokens"):
                torch._dynamo.decorators.mark_unbacked(tensor, dim)
            elif tensor.shape[dim] > 1:
                torch._dynamo.mark_dynamic(tensor, dim)


def _vocab_size(captured: fx.GraphModule) -> int | None:
    """Rows of the embedding table that ``input_ids`` indexes, read from the graph (None: not found)."""
    ids = next(n for n in captured.graph.nodes if n.op == "placeholder")
    for node in ids.users:
        if node.target == torch.ops.aten.embedding.default and node.args[1] is ids and "val" in node.args[0].meta:
            return int(node.args[0].meta["val"].shape[0])
    return None
