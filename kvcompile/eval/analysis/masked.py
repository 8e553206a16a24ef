"""Evaluation-only attention that keeps the full cache and masks what a selection evicted: what a pipeline that
stores per-head selections as masks computes (kvpress's AdaKV and KVzip presses: ``masked_key_indices``), while
holding every byte of the document.

The plain transformers model (a ``CompressedModel``'s ``source``) runs with its own ``DynamicCache``; a registered
attention function (``NAME``) adds, for the calls given ``kvc_keep`` [L, Hkv, n], a mask per (layer, KV head) over
the first n positions (the document), shared by the head's query heads; later keys (the question, the answer) stay
visible under the causal mask. Nothing of the library's cache or kernels is used, so the path is an independent
reference: at budget 1.0 it is the plain model, and with a selection it equals attention over the kept entries
(``tests/test_analysis_nominal.py``). ``kvc_bias`` [L, Hkv, n] adds a log-weight to the logits of those positions
(a boost of w times their attention before renormalising: ``diagnose``'s evidence boost), in every query after
the document. Batch 1. Training under compression runs it too (``train.sparse_finetune``): one pass over document +
continuation, gradients through both.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "kvcompile-masked"


def masked_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     kvc_keep: Tensor | None = None, kvc_bias: Tensor | None = None, **kwargs):
    """SDPA, with the keys that ``kvc_keep[module.layer_idx]`` [Hkv, n] marks evicted masked out of every query past
    the document, and ``kvc_bias[module.layer_idx]`` [Hkv, n] (if given) added to those queries' logits of the first n
    keys. The document's own queries read it whole, as the prefill that wrote the cache did, so one pass over document
    + continuation equals reading the continuation from the compressed cache (gradients flow: ``train``)."""
    if kvc_keep is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    Tq, Tk = query.shape[2], key.shape[2]
    keep, G = kvc_keep[module.layer_idx], query.shape[1] // key.shape[1]
    n = keep.shape[-1]
    after = torch.arange(Tk - Tq, Tk, device=query.device) >= n  # query rows past the document
    visible = F.pad(keep, (0, Tk - n), value=True).repeat_interleave(G, 0)[:, None, :] | ~after[:, None]
    if attention_mask is None:  # transformers skipped a plain causal mask: query i sits at key Tk - Tq + i
        attention_mask = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril(Tk - Tq)[None, None]
    elif attention_mask.dtype != torch.bool:  # additive: 0 where allowed
        attention_mask = attention_mask == 0
    kwargs.pop("is_causal", None)
    mask = attention_mask[..., -Tk:] & visible[None]
    if kvc_bias is not None:  # a float mask: -inf where masked, the bias where visible, in the rows past the document
        bias = F.pad(kvc_bias[module.layer_idx], (0, Tk - n)).repeat_interleave(G, 0).to(query.dtype)
        mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf")) + \
            bias[None, :, None, :] * after[:, None]
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


AttentionInterface.register(NAME, masked_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def masking(model):
    """``model`` runs its attention through ``masked_attention`` inside the block (restored after)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def kept(held_positions: Tensor, n: int) -> Tensor:
    """[L, Hkv, n] True at the first n positions each (layer, KV head) holds, from ``held_positions`` [L, 1, Hkv,
    S] (``CompressedModel.held_positions``; -1 past a head's entries)."""
    pos = held_positions[:, 0].long()
    pos = torch.where((pos >= 0) & (pos < n), pos, n)
    out = torch.zeros(*pos.shape[:2], n + 1, dtype=torch.bool, device=pos.device)
    return out.scatter_(-1, pos, True)[..., :n]


class MaskedModel:
    """The plain ``model`` over a prefilled document ``cache`` (a ``DynamicCache``, copied), attending to the
    entries ``keep`` [L, Hkv, n] marks, with ``bias`` [L, Hkv, n] (or None) added to their logits. ``prefill`` /
    ``decode`` return logits as ``CompressedModel``'s do, so the evaluation read-out (``decoding.answer``) drives it;
    call them inside ``masking(model)``."""

    def __init__(self, model, keep: Tensor, cache: DynamicCache, bias: Tensor | None = None):
        self.model, self.keep, self.bias, self.cache = model, keep, bias, copy.deepcopy(cache)
        self.generation_config = getattr(model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def prefill(self, input_ids: Tensor) -> Tensor:
        """Logits [1, T, V] of ``input_ids`` [1, T] read after what the cache holds."""
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True, kvc_keep=self.keep,
                          kvc_bias=self.bias).logits

    decode = prefill


@torch.no_grad()
def document(model, input_ids: Tensor) -> DynamicCache:
    """The plain model's cache after reading ``input_ids`` [1, n] with full attention (as a mask pipeline
    prefills before it selects)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, cache=cache, use_cache=True)
    return cache
