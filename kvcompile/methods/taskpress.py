"""TaskPress (docs/methods_scorers.md#taskpress): a task-guided meta-query's attention, weighted by each value's
quantization scale.

No paper, code or summary was found under this name; everything here is inferred from a one-line description, so
its recipe's provenance is "description". What is known: the score combines (1) the attention of a short,
task-type meta-query ("answer a question about the text above") read after the context instead of the user's
question, and (2) the scale a group-quantized cache stores for each token, as a free importance proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, QueryWindow, Reconstruction, protect, register_scorer
from .kvzip import KVzip

UNRESOLVED = ("taskpress reads its meta-query as token ids, which depend on the tokenizer: resolve the recipe first "
              "with kvcompile.recipes.anchors.resolve(recipe, tokenizer), give instruction_ids= (the meta-query's "
              "ids), or meta_query='' to score by the quantization scale alone")


def value_scale(values: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[..., S] each row's mean step of asymmetric ``bits``-bit codes over groups of ``group`` channels: the scale an
    ``int<bits>`` page stores per group (``kernels.formats.IntCodec``, before its fp16 rounding), averaged."""
    D = values.shape[-1]
    g = values.float().unflatten(-1, (D // min(group, D), -1))
    return ((g.amax(-1) - g.amin(-1)) / (2**bits - 1)).mean(-1)


@register_scorer("taskpress")
@dataclass
class TaskPress(KVzip):
    """Score = the largest attention any meta-query token pays the held token (max over the GQA group, KVzip's
    probe with the meta-query in place of the context's copy) times the token's value quantization scale
    (``value_scale``: int4, groups of 32, as ``int4`` pages store it); the first ``n_sink`` tokens are always kept.
    ``instruction_ids`` are the meta-query's token ids (``kvcompile.recipes.anchors.resolve`` fills them from
    ``meta_query`` for a tokenizer); with ``meta_query=""`` the scale alone ranks (no extra pass), and with
    ``scaled=False`` the meta-query's attention alone (the two ablations of the product).

    Inferred (all of it): the product of the two signals (attention times the value scale); the value scale
    rather than the key's (the key scale tracks the key norm, which KNorm reads the other way round); the default
    meta-query text; one read of the meta-query after the whole context, whose tokens are dropped after scoring."""

    meta_query: str = "Answer the question about the text above."  # its ids: ``instruction_ids`` (``resolve``)
    bits: int = 4
    group: int = 32
    scaled: bool = True  # False: the meta-query's attention alone (the ablation of the scale)

    def __post_init__(self):
        super().__post_init__()
        if self.bits not in (2, 3, 4, 8) or self.group < 1:
            raise ValueError(f"taskpress: bits must be 2, 3, 4 or 8 and group >= 1, got {self.bits}, {self.group}")
        if not (self.scaled or self.meta_query):
            raise ValueError("taskpress: with scaled=False and meta_query='' nothing scores the tokens")
        if bool(self.meta_query) != bool(self.instruction_ids):
            raise ValueError(UNRESOLVED if self.meta_query else "taskpress: instruction_ids are the meta-query's "
                             "token ids; with meta_query='' there are none")

    @property
    def observation_window(self) -> int:
        return self.window if self.instruction_ids else 0

    def sources(self):
        return (QueryWindow(self.window), Reconstruction()) if self.instruction_ids else ()

    def reconstruction_prompt(self, input_ids, real):
        meta = torch.tensor(self.instruction_ids, dtype=input_ids.dtype, device=input_ids.device)
        meta = meta.expand(input_ids.shape[0], -1)
        return meta, torch.ones(meta.shape, dtype=torch.bool, device=real.device)

    def key_weights(self, obs: Observation):
        if not self.scaled:
            return None
        G = obs.queries.shape[1] // obs.keys.shape[1]
        return value_scale(obs.values, self.bits, self.group).repeat_interleave(G, 1)

    def score_per_query_head(self, obs: Observation):
        return super().score_per_query_head(obs) if self.instruction_ids else None

    def score(self, obs: Observation):
        if self.instruction_ids:
            return super().score(obs)
        return protect(value_scale(obs.values, self.bits, self.group), obs.positions < self.n_sink)
