"""Observation sources: what a method reads at compression time beyond the held keys and values.

A method declares its sources (``Scorer.sources``); the runtime supplies them through one mechanism
(``kvcompile.observation``) and refuses, at ``apply``, a source it cannot supply yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Something a method reads besides the held keys and values."""


@dataclass(frozen=True)
class QueryWindow(Source):
    """The last ``size`` queries of every layer: ``Observation.queries`` / ``query_positions``."""

    size: int


@dataclass(frozen=True)
class Reconstruction(Source):
    """A prompt (``Scorer.reconstruction_prompt``) prefilled after the context before scoring, its queries alone in
    the window, its tokens dropped again after compression (KVzip's context reconstruction)."""


@dataclass(frozen=True)
class Question(Source):
    """The question's queries alone in the window, read apart from the context (``observation.reads_question``)."""


@dataclass(frozen=True)
class ContextTokens(Source):
    """The token id of every held entry: ``Observation.token_ids`` [B, Hkv, S]."""


@dataclass(frozen=True)
class Segments(Source):
    """The segment index of every position read so far: ``Observation.segments`` [B, P] (the caller's
    ``segments=``, ``kvcompile.segments``; all 0 when none were given). Step-level methods keep or evict them as
    units."""


@dataclass(frozen=True)
class LayerWeights(Source):
    """A weight of the layer, read from the captured graph: ``"o_proj"``, the attention output projection
    [hidden, Hq * D] (W_O), in ``Observation.weights``."""

    name: str


def output_projection(obs):
    """[hidden, Hq, D] the ``"o_proj"`` weight of an observation split by query head (what head r's attention output
    adds to the residual stream goes through [:, r])."""
    w_o = obs.weights["o_proj"].float()  # [hidden, Hq * D]
    return w_o.view(w_o.shape[0], -1, obs.keys.shape[-1])


@dataclass(frozen=True)
class HiddenStates(Source):
    """Each layer's attention input (the normed hidden state its key and value projections read) for every held
    entry: ``Observation.hidden`` [B, Hkv, S, hidden], from one dense forward pass of the source model over the
    context (``kvcompile.attention_inputs``), so the context is read in one prefill."""


@dataclass(frozen=True)
class Restore(Source):
    """``tokens`` restore entries per (layer, KV head), written before compressing: one dense forward of the source
    model, with the method's LoRA adapter on, over its learned embeddings (``Scorer.restore_inputs``) at the next
    ``tokens`` positions, attending to the whole cache (``kvcompile.restoring``). They are ordinary cache entries,
    kept before anything else and charged to the budget (RestoreKV)."""

    tokens: int


@dataclass(frozen=True)
class ExtraPass(Source):
    """A second forward pass over the context with a method's own inputs (not supplied yet)."""


@dataclass(frozen=True)
class Gradients(Source):
    """For each observed query of a ``Reconstruction`` prompt, the norm of the gradient of the squared last hidden
    states at that prompt with respect to the query's attention output (``Observation.query_gradients``), from one
    dense backward pass of the source model (``kvcompile.gradients``)."""
