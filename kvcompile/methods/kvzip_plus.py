"""KVzip+ (KVzap, https://arxiv.org/abs/2601.07891; kvpress ``kvzip_plus_normalization``): KVzip's reconstruction
attention, normalised by what each probe reads and weighted by what each value writes."""

from __future__ import annotations

from dataclasses import dataclass

from .base import LayerWeights, Observation, ProbeInputNorms, QueryWindow, Reconstruction, register_scorer
from .kvzip import KVzip
from .sources import output_norms


@register_scorer("kvzip-plus")
@dataclass
class KVzipPlus(KVzip):
    """Score of key c for query head r: the max over reconstruction probes p of A_{p,c} / ||h_p||, times
    ||W_O^r v_c||, then the max over the GQA group; h_p is the probe's attention input (its normed hidden state). A
    probe whose input is large reads its keys less per unit of attention, and a value that W_O shrinks writes less
    into the residual stream, so both move a token's score towards what it contributes (the score KVzap learns to
    predict). Sinks and the probes' own tokens as in KVzip.

    Inferred: kvpress replays the context in chunks after a "Repeat the previous context" prompt; here the whole
    context is one chunk with no instruction (KVzip's inference in this library). The probe norms come from one dense
    forward pass of the source model over the context and the prompt (``ProbeInputNorms``)."""

    def sources(self):
        return QueryWindow(self.window), Reconstruction(), LayerWeights("o_proj"), ProbeInputNorms()

    def probe_weights(self, obs: Observation):
        return 1.0 / obs.query_input_norms.clamp_min(1e-12)  # a slot without a query has no attention to scale

    def key_weights(self, obs: Observation):
        return output_norms(obs)

    def score_per_query_head(self, obs: Observation):
        if obs.query_input_norms is None:
            raise ValueError("kvzip-plus reads the ProbeInputNorms source, which this observation lacks")
        return super().score_per_query_head(obs)
