"""AnchorKV's compression (docs/methods_formats.md#anchorkv): every held token goes to ``anchor2`` pages as its nearest
anchor scaled (``methods.anchorkv``), and the residuals of the tokens whose approximation most moves the output are
coded (``kernels.anchored``), as many as the byte budget leaves once the anchors and every token's row are paid for.

AnchorKV pools the residual count over a layer's heads and splits it between keys and values; here every layer gets an
equal share of what the budget leaves, halved between keys and values (the split is inferred), and the rows of one batch
get as many residual slots as the tightest of them affords (their tables share one shape).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import PagedKVCache
from .kernels import anchored
from .methods.anchorkv import AnchorKV, nearest
from .methods.rope import pre_rope
from .observation import observe
from .plan import STORED_FORMAT, AnchoredEntries, Plan


def base_bytes(cache: PagedKVCache, held: Tensor, method: AnchorKV = AnchorKV()) -> Tensor:
    """[B] bytes a row pays before any residual when its heads hold ``held`` [L, B, Hkv] tokens: every token's rows
    (page rounding included) and its anchor tables (the widest head's anchors, plus the RoPE row)."""
    rows = cache.pages_held(held).sum(dim=(0, 2)) * cache.stored_page_bytes
    L, Hkv, D = cache.num_layers, cache.num_kv_heads, cache.head_dim
    return rows + L * 2 * Hkv * (1 + anchor_width(held, method)) * D * 4


def check_fits(cache: PagedKVCache, held: Tensor, budget_bytes: Tensor, budget: str) -> None:
    """Raise when the anchors and every token's rows (``base_bytes``) of heads holding ``held`` [L, B, Hkv] tokens
    exceed ``budget_bytes`` [B] (``budget`` names it)."""
    need = base_bytes(cache, held)
    if bool((need > budget_bytes).any()):
        raise ValueError(f"AnchorKV's anchors and the rows of every token need {int(need.max())} bytes in a "
                         f"sequence, over {budget}; raise the budget")


def anchor_width(held: Tensor, method: AnchorKV) -> int:
    """Anchors of the head with the most: max(window, S / per_anchor) of its S tokens (at most S)."""
    n = int(held.max()) if held.numel() else 0
    return min(n, max(method.window, n // method.per_anchor))


def plan(cache: PagedKVCache, layers, budget_bytes: Tensor, method: AnchorKV = AnchorKV()) -> Plan:
    """The plan that stores every held token as AnchorKV's rows within ``budget_bytes`` [B] (``base_bytes`` fit:
    ``compress.check_fits`` refused the prompt before it was written otherwise)."""
    L, B, Hkv, D = cache.num_layers, cache.batch_size, cache.num_kv_heads, cache.head_dim
    held = cache.held().long()
    K, A, width = max(int(held.max()), 1), anchor_width(held, method), anchored.residual_bytes(D)
    spare = int((budget_bytes - base_bytes(cache, held, method)).min())
    slots = min(max(spare // (L * 2 * width), 0), Hkv * K, anchored.MAX_SLOTS)  # at most one a token
    rows = torch.zeros(L, B, Hkv, K, 2, 3, dtype=torch.int16, device=cache.device)
    tables = torch.zeros(L, 2, B, Hkv, 1 + A, D, device=cache.device)
    residuals = torch.zeros(L, 2, B, slots, width, dtype=torch.uint8, device=cache.device)
    for layer in layers:
        obs = observe(cache, layer)
        inv_freq = obs.weights.get("inv_freq")
        if inv_freq is not None:
            if 2 * inv_freq.shape[0] != D:
                raise NotImplementedError(f"AnchorKV pages rotate whole keys; this model's RoPE turns "
                                          f"{2 * inv_freq.shape[0]} of {D} channels")
            tables[layer.index, 0, :, :, 0, : D // 2] = inv_freq.float()
        present = method.anchors(obs)
        found = [_assign(x, present, A) for x in (pre_rope(obs, obs.keys.float(), obs.positions), obs.values.float())]
        utilities = method.utilities(obs, found[0][3], found[1][3])
        for part, ((vectors, index, gamma, residual), utility) in enumerate(zip(found, utilities)):
            slot, codes = _refine(residual, utility.masked_fill(~obs.valid | present, float("-inf")), slots)
            tables[layer.index, part, :, :, 1:] = vectors
            residuals[layer.index, part, :, : codes.shape[1]] = codes
            rows[layer.index, :, :, : present.shape[-1], part] = anchored.encode_rows(index, gamma, slot)[:, :, :K]
    keep = torch.arange(K, device=cache.device).expand(L, B, Hkv, K)
    return Plan(keep, held, formats=torch.full_like(keep, STORED_FORMAT),
                anchored=AnchoredEntries(rows, tables, residuals))


def _assign(x: Tensor, present: Tensor, A: int) -> tuple[Tensor, ...]:
    """Rows x [B, Hkv, S, D] against their head's anchors (``present`` [B, Hkv, S]): the anchors [B, Hkv, A, D]
    (zero past a head's own), and each row's anchor index, fp16-rounded scale and residual (an anchor: itself, 1, 0)."""
    order = present.float().argsort(dim=-1, descending=True, stable=True)[..., :A]  # each head's anchors first
    held = present.gather(-1, order)
    vectors = x.gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1])) * held[..., None]
    own = torch.zeros_like(present, dtype=torch.long).scatter(-1, order,
                                                              torch.arange(A, device=x.device).expand_as(order))
    index, gamma = nearest(x, vectors, held)
    index = torch.where(present, own, index)
    gamma = torch.where(present, 1.0, gamma).half().float()
    return vectors, index, gamma, x - gamma[..., None] * vectors.gather(2, index[..., None].expand_as(x))


def _refine(residual: Tensor, utility: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """The ``slots`` residuals [B, Hkv, S, D] of highest ``utility`` [B, Hkv, S] (-inf: never), the heads pooled:
    each row's slot [B, Hkv, S] (-1: none) and the coded residuals [B, n, W] in slot order."""
    B, Hkv, S, D = residual.shape
    score = utility.flatten(1)
    top = score.topk(min(slots, score.shape[1]), -1).indices
    chosen = score.gather(-1, top) > float("-inf")
    slot = torch.full_like(score, -1, dtype=torch.long).scatter(-1, top, torch.arange(top.shape[1], device=top.device)
                                                                .expand_as(top).masked_fill(~chosen, -1))
    codes = anchored.encode_residuals(residual.flatten(1, 2).gather(1, top[..., None].expand(-1, -1, D)))
    return slot.view(B, Hkv, S), codes * chosen[..., None]
