"""KVgrad (https://openreview.net/forum?id=cg1wTCJjjk, kvpress ``KVgradPress``): KVzip's reconstruction attention,
weighted by what each probe's attention output does to the model's output and by what each value does through W_O."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Gradients, LayerWeights, Observation, QueryWindow, Reconstruction, register_scorer
from .kvzip import KVzip
from .sources import output_norms


@register_scorer("kvgrad")
@dataclass
class KVgrad(KVzip):
    """Score of key c for query head r: the max over reconstruction probes p of A_{p,c} * ||dPhi/da_p|| times
    ||W_O^r v_c||, then the max over the GQA group. Phi is the sum over probes of the squared norm
    of the last decoder layer's output, a_p the layer's attention output at p (``kvcompile.gradients``: one dense
    backward pass of the source model over context and probes). Sinks and the probes' own tokens as in KVzip.

    Inferred: kvpress replays the context in 512-token chunks, each after its "Repeat the previous context"
    prompt, over a read-only cache; here the whole context is one chunk with no instruction (KVzip's own inference
    in this library), and the backward pass runs on the source model rather than the paged programs."""

    def sources(self):
        return QueryWindow(self.window), Reconstruction(), LayerWeights("o_proj"), Gradients()

    def probe_weights(self, obs: Observation):
        return obs.query_gradients

    def key_weights(self, obs: Observation):
        return output_norms(obs)  # the same for every probe: applied once, after the max over probes

    def score_per_query_head(self, obs: Observation):
        if obs.query_gradients is None:
            raise ValueError("kvgrad reads the Gradients source, which this observation lacks")
        return super().score_per_query_head(obs)

