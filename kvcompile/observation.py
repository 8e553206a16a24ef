"""What a method may read at compression time, supplied through one mechanism.

A method declares its sources (``methods.sources.Source``: ``Scorer.sources``); ``check`` refuses, at ``apply``, any
source the runtime cannot supply yet (an extra pass with the method's own inputs); ``observe`` builds a layer's
``Observation`` from the cache (held keys, values and positions; the ring's queries; the token ids it logs for
``ContextTokens``; the caller's segments for ``Segments``) and the layer's weights (``LayerWeights``: W_O, found in
the graph); ``reconstructing`` runs, around one compression, a ``Reconstruction`` source's prompt, with
``Gradients`` one backward pass over the context and that prompt, and for ``HiddenStates`` one dense forward pass
over the context; ``reads_question`` tells ``generate`` to read the context unobserved and compress after the
question (``Question``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from .attention_inputs import attention_inputs
from .cache import PagedKVCache
from .gradients import attention_output_gradients
from .methods import Observation
from .methods.sources import Source
from .restoring import restore
from .segments import segment_of
from .spec import LayerSpec


def check(sources: tuple[Source, ...], who: str, layers: tuple[LayerSpec, ...] = ()) -> None:
    """Raise, naming the source, when ``who`` declares one the runtime does not supply, or (given the ``layers``)
    a layer weight the captured graph did not yield for every layer."""
    for source in sources:
        if not source.supplied:
            raise NotImplementedError(f"{who} reads {type(source).__name__}, which kvcompile does not supply yet")
        name = source.layer_weight
        missing = [layer.index for layer in layers if name is not None and name not in layer.weights]
        if missing:
            raise NotImplementedError(f"{who} reads the layer weight {name!r}, which the graph does not yield "
                                      f"for layers {missing} (found: {sorted(layers[0].weights)})")


def keeps_ids(sources: tuple[Source, ...]) -> bool:
    """Whether the cache must log the token id of every position (``ContextTokens``)."""
    return any(s.logs_ids for s in sources)


def reads_question(sources: tuple[Source, ...]) -> bool:
    """Whether the scorer ranks by the question's queries (``Question``): ``generate(question, context_ids=...)`` then
    reads the context unobserved and compresses context and question together after the question, so the window
    holds the question alone; a compression without the question apart is refused."""
    return any(s.after_question for s in sources)


def window(sources: tuple[Source, ...]) -> int:
    """Queries per layer the observation ring must keep for these sources."""
    return max((s.ring for s in sources), default=0)


def reads_dense(sources: tuple[Source, ...]) -> bool:
    """Whether compression runs the source model densely over every token read (``Gradients``, ``HiddenStates``,
    ``Restore``): the context must then be read in one go, before any compression, by a model built from a source
    model (not a loaded artifact)."""
    return any(s.dense for s in sources)


def restores(sources: tuple[Source, ...]) -> int:
    """Restore entries per (layer, KV head) the sources ask the runtime to write before compressing (``Restore``)."""
    return sum(s.restore_tokens for s in sources)


def observe(cache: PagedKVCache, layer: LayerSpec, dense: dict | None = None) -> Observation:
    """Layer ``layer`` of the cache as a method sees it (dense per-head views plus the ring's queries); ``dense``:
    what ``reconstructing`` yields (``"gradients"`` and ``"probe_norms"`` [L, B, W], ``"hidden"`` [L, B, P, hidden])."""
    dense = dense or {}
    keys, values, positions, valid = cache.dense(layer.index)
    ring = cache.ring
    ids = cache.token_ids.gather(1, positions.flatten(1).clamp_min(0)).view_as(positions) if cache.keep_ids else None
    return Observation(
        keys, values, positions, valid, ring.queries[layer.index], ring.positions, layer.scale, layer.window,
        layer.index, cache.num_layers, ids, _weights(layer, keys.device), cache.log_weights(layer.index),
        segment_of(cache.segment_starts, int(cache.seen.max())) if cache.segment_starts.shape[1] else None,
        dense["gradients"][layer.index] if "gradients" in dense else None,
        _held_rows(dense["hidden"][layer.index], positions) if "hidden" in dense else None,
        dense["probe_norms"][layer.index] if "probe_norms" in dense else None,
        ring.lse[layer.index],
    )


def _held_rows(table: Tensor, positions: Tensor) -> Tensor:
    """[B, Hkv, S, F]: ``table`` [B, P, F] (a row per position) at each held entry's position [B, Hkv, S]."""
    B, Hkv, S = positions.shape
    at = positions.clamp(0, table.shape[1] - 1).reshape(B, Hkv * S, 1).expand(-1, -1, table.shape[-1])
    return table.gather(1, at).view(B, Hkv, S, -1)


def _weights(layer: LayerSpec, device) -> dict:
    """The layer weights a method may read, plus its RoPE inverse frequencies (``methods.rope``) when known."""
    return layer.weights | ({"inv_freq": torch.tensor(layer.rotary, device=device)} if layer.rotary else {})


@contextlib.contextmanager
def reconstructing(scorer, prefill, cache: PagedKVCache, input_ids: Tensor | None, real: Tensor | None,
                   source: nn.Module | None = None, dense: bool = True):
    """Around one compression, for the tokens just read (``input_ids``, ``real`` [B, T]): with ``HiddenStates`` (and
    ``dense``), run ``source`` densely over them for each layer's attention input; when ``scorer`` declares a
    ``Reconstruction``, prefill its prompt with the ring cleared, so the window holds the prompt's queries alone, and
    afterwards drop the prompt's tokens (``PagedKVCache.drop_from``); ``prefill(ids, real)`` runs one prefill step. With
    ``Restore`` (and ``dense``), the restore entries are appended first (``restoring``) and stay. Yields a dict:
    ``"hidden"`` [L, B, P, hidden] (``attention_inputs``), ``"restored"`` ([B] the position of each row's first restore
    entry, how many per head), and with ``Gradients`` (and ``dense``) ``"gradients"``, the gradient norms [L, B, W] of
    the window's queries, from one dense backward pass of ``source`` over ``input_ids`` and the prompt; with
    ``ProbeInputNorms`` (and ``dense``) ``"probe_norms"``, the norms [L, B, W] of those queries' attention inputs, from
    one dense forward pass over the same tokens. A dense pass replays every token the cache read: checked."""
    sources = scorer.sources() if scorer is not None and input_ids is not None else ()
    seen, supplied = cache.seen.clone(), {}
    if dense and reads_dense(sources) and not torch.equal(seen, real.sum(1).to(seen)):
        raise ValueError("a dense pass of the source model replays every token the cache read, but some were "
                         "compressed earlier: read the prompt in one prefill, before any compression")
    if dense and any(s.hidden for s in sources):
        supplied["hidden"] = attention_inputs(source, input_ids.to(cache.device), real.to(cache.device))
    n_restore = restores(sources)
    if dense and n_restore:  # entries that stay: the reconstruction comes after
        supplied["restored"] = (restore(cache, source, *scorer.restore_inputs()), n_restore)
        seen = cache.seen.clone()
    if not any(s.reconstructs for s in sources):
        yield supplied
        return
    ids, mask = scorer.reconstruction_prompt(input_ids, real)
    cache.ring.clear()
    prefill(ids, mask.to(cache.device))
    if dense and any(s.gradients or s.probe_norms for s in sources):
        both = torch.cat([input_ids, ids], 1), torch.cat([real.bool(), mask.to(real.device).bool()], 1)
        if any(s.gradients for s in sources):
            supplied["gradients"] = _window_gradients(source, cache, *both, real.shape[1])
        if any(s.probe_norms for s in sources):
            by_position = attention_inputs(source, both[0].to(cache.device), both[1].to(cache.device), norms=True)
            supplied["probe_norms"] = _at_window(by_position[..., 0], cache.ring.positions)
    yield supplied
    cache.drop_from(seen)


def _window_gradients(source: nn.Module, cache: PagedKVCache, ids: Tensor, real: Tensor, context: int) -> Tensor:
    """[L, B, W] the gradient norm at every window slot's query, from ``attention_output_gradients`` over ``ids``
    [B, T] whose tokens after the first ``context`` are the probes; a token's position is its real tokens before."""
    probes = real.clone()
    probes[:, :context] = False
    norms = attention_output_gradients(source, ids, real, probes)  # [L, B, T]
    positions = (real.long().cumsum(1) - 1).clamp_min(0)
    table = norms.new_zeros(*norms.shape[:2], int(positions.max()) + 1)
    table.scatter_add_(2, positions.expand_as(norms), norms * real)
    return _at_window(table, cache.ring.positions)


def _at_window(table: Tensor, slots: Tensor) -> Tensor:
    """[L, B, W]: ``table`` [L, B, P] (a value per position) at each window slot's query position ``slots`` [B, W],
    0 where a slot holds no query."""
    read = table.gather(2, slots.clamp(0, table.shape[2] - 1).expand(table.shape[0], -1, -1))
    return read.masked_fill(slots[None] < 0, 0.0)
