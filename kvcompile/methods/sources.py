"""Observation sources: what a method reads at compression time beyond the held keys and values.

A method declares its sources (``Scorer.sources``); the runtime supplies them through one mechanism
(``kvcompile.observation``) and refuses, at ``apply``, a source it cannot supply yet. Each source says what the
runtime must do for it, as data (the ``Source`` attributes), so the runtime asks a source rather than its type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Source:
    """Something a method reads besides the held keys and values, and what supplying it takes (class attributes,
    overridden by each source that needs one)."""

    supplied = True  # the runtime supplies it (False: refused at ``apply``)
    ring = 0  # queries per layer the observation ring must keep
    logs_ids = False  # the cache logs the token id of every position
    after_question = False  # the context is read unobserved and compressed after the question, which the ring holds
    reconstructs = False  # a prompt of the method's is prefilled before scoring and dropped after
    dense = False  # one dense pass of the source model over every token read (the context read in one prefill)
    hidden = False  # that pass yields each layer's attention input
    gradients = False  # a dense backward pass yields the gradients at the reconstruction prompt's queries
    probe_norms = False  # a dense pass over the context and the reconstruction prompt yields its queries' input norms
    restore_tokens = 0  # entries per (layer, KV head) written before compressing
    layer_weight = None  # the name of a weight of every layer that the captured graph must yield


@dataclass(frozen=True)
class QueryWindow(Source):
    """The last ``size`` queries of every layer: ``Observation.queries`` / ``query_positions``."""

    size: int

    @property
    def ring(self) -> int:
        return self.size


@dataclass(frozen=True)
class Reconstruction(Source):
    """A prompt (``Scorer.reconstruction_prompt``) prefilled after the context before scoring, its queries alone in
    the window, its tokens dropped again after compression (KVzip's context reconstruction)."""

    reconstructs = True


@dataclass(frozen=True)
class Question(Source):
    """The question's queries alone in the window, read apart from the context (``observation.reads_question``)."""

    after_question = True


@dataclass(frozen=True)
class ContextTokens(Source):
    """The token id of every held entry: ``Observation.token_ids`` [B, Hkv, S]."""

    logs_ids = True


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

    @property
    def layer_weight(self) -> str:
        return self.name


def output_projection(obs):
    """[hidden, Hq, D] the ``"o_proj"`` weight of an observation split by query head (what head r's attention output
    adds to the residual stream goes through [:, r])."""
    w_o = obs.weights["o_proj"].float()  # [hidden, Hq * D]
    return w_o.view(w_o.shape[0], -1, obs.keys.shape[-1])


def output_norms(obs):
    """[B, Hq, S] ||W_O^r v_c|| for every query head r and held value c: how much value c can move the residual
    stream through head r. Computed as v' (W_O^r' W_O^r) v per head, so no [S, hidden] product is built."""
    per_head = output_projection(obs)  # [hidden, Hq, D]
    Hq, Hkv = per_head.shape[1], obs.values.shape[1]
    gram = torch.einsum("ehd,ehf->hdf", per_head, per_head)  # [Hq, D, D]
    values = obs.values.float().repeat_interleave(Hq // Hkv, 1)  # [B, Hq, S, D]
    return torch.einsum("bhsd,hdf,bhsf->bhs", values, gram, values).clamp_min(0).sqrt()


@dataclass(frozen=True)
class HiddenStates(Source):
    """Each layer's attention input (the normed hidden state its key and value projections read) for every held
    entry: ``Observation.hidden`` [B, Hkv, S, hidden], from one dense forward pass of the source model over the
    context (``kvcompile.attention_inputs``), so the context is read in one prefill."""

    dense = hidden = True


@dataclass(frozen=True)
class Restore(Source):
    """``tokens`` restore entries per (layer, KV head), written before compressing: one dense forward of the source
    model, with the method's LoRA adapter on, over its learned embeddings (``Scorer.restore_inputs``) at the next
    ``tokens`` positions, attending to the whole cache (``kvcompile.restoring``). They are ordinary cache entries,
    kept before anything else and charged to the budget (RestoreKV)."""

    tokens: int
    dense = True

    @property
    def restore_tokens(self) -> int:
        return self.tokens


@dataclass(frozen=True)
class ExtraPass(Source):
    """A second forward pass over the context with a method's own inputs (not supplied yet)."""

    supplied = False


@dataclass(frozen=True)
class Gradients(Source):
    """For each observed query of a ``Reconstruction`` prompt, the norm of the gradient of the squared last hidden
    states at that prompt with respect to the query's attention output (``Observation.query_gradients``), from one
    dense backward pass of the source model (``kvcompile.gradients``)."""

    dense = gradients = True


@dataclass(frozen=True)
class ProbeInputNorms(Source):
    """For each observed query of a ``Reconstruction`` prompt, the norm of its attention input (the normed hidden
    state its query projection reads: ``Observation.query_input_norms``), from one dense forward pass of the source
    model over the context and the prompt (``kvcompile.attention_inputs``)."""

    dense = probe_norms = True
