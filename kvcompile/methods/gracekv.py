"""GraceKV ("Every Cache Entry Earns Its Place", arXiv 2608.07001): a prototype tree per slot
of each (layer, KV head), and one global greedy allocation in which "add coverage" (keep a dropped slot as its root
prototype) and "add resolution" (split a node into its children) compete for the byte budget by gain per entry."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import PROTOTYPES, Allocator, Observation, register_allocator
from .shares import attention_mass

_EPS = 1e-8  # the distortion's epsilon, on attention partitions normalised to the query's full partition (<= 1)
_DROPPED = 2.0  # distortion of a dropped node: no partition and no output (lambda_Z = lambda_M = 1)


@register_allocator("gracekv")
@dataclass
class GraceKV(Allocator):
    """Prototype trees and a global greedy allocation (docs/methods_allocators.md#gracekv).

    Each head's tokens (pinned ones aside, when they fit: kept exactly, charged first) form slots of ``slot``
    tokens in position order; each slot is a binary tree of contiguous halves down to single tokens. A node's
    prototype: key the mean of its keys, value the mean of its values weighted by relevance + beta (beta = 0.1 x
    the head's mean relevance), position the rounded mean position, log-weight log m_eff with m_eff = clamp(n
    hbar^2, 1, n), hbar = |mean k| / (mean |k| + eps): n identical keys give m_eff = n, so the entry draws exactly
    the attention of its n tokens. Its distortion D (step 3) over the probe queries u (the ``probes`` newest
    observed queries, each with its GQA group), weighted by the node's attention mass under each: (Z - Z~)^2 /
    (Z^2 + eps) + |M - M~|^2 / (|M|^2 + eps) (Z the node's attention partition, M its weighted value sum, ~ for the
    prototype). A node's error is R x D (R: its share of the scorer's attention mass; a dropped slot has D = 2).
    The greedy pops the best gain per entry: coverage (R (2 - D_root), 1 entry) or a split (R D_parent - sum R_c
    D_c, children - 1 entries), every slot's root first while the budget holds one per slot (the singleton floor),
    each action only if the row's pages still fit. Single-token nodes are kept as the original tokens.

    With ``merged=False`` (a control: the same allocation without merging), every prototype of several tokens is
    replaced by its most relevant token, unweighted, at the same cost.
    """

    slot: int = 64
    beta: float = 0.1
    probes: int = 8  # the newest observed queries the distortion is measured on (each with its GQA group)
    merged: bool = True

    strategy = PROTOTYPES

    def __post_init__(self):
        if self.slot < 2 or self.slot & (self.slot - 1):
            raise ValueError(f"slot must be a power of two >= 2, got {self.slot}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")

    def prototypes(self, observations: list[Observation], scores: Tensor, max_pages: Tensor, page_size: int):
        """(kept [L, B, Hkv, S], keys, values [L, B, Hkv, E, D], positions, log-weights [L, B, Hkv, E], counts
        [L, B, Hkv]): the original tokens each head keeps and the prototypes it writes, at most ``max_pages`` [B]
        pages of ``page_size`` entries per row in all."""
        mass, pins = attention_mass(scores)
        pinned_pages = (-(-pins.sum(-1) // page_size)).sum((0, 2))  # [B]
        pinned = pins & (pinned_pages <= max_pages)[None, :, None, None]  # else the pins join the trees,
        mass = torch.where(pins & ~pinned, mass.amax(-1, keepdim=True), mass)  # as relevant as the head's best
        trees = [self._tree(obs, mass[i], pinned[i]) for i, obs in enumerate(observations)]
        chosen = self._allocate(trees, pinned.sum(-1), max_pages, page_size)  # [L, B, Hkv, nodes] per level
        return self._entries(observations, trees, chosen, pinned)

    def _tree(self, obs: Observation, mass: Tensor, pinned: Tensor) -> dict:
        """One layer's slots in tree order and every node's error, level by level (level l: 2^l nodes a slot)."""
        B, Hkv, S, D = obs.keys.shape
        mass, pinned = F.pad(mass, (0, max(S - mass.shape[-1], 0)))[..., :S], pinned[..., :S]
        free = obs.valid & F.pad(~pinned, (0, S - pinned.shape[-1]), value=False)
        order = (~free).long().argsort(dim=-1, stable=True)  # free tokens first, in position order
        n = int(free.sum(-1).max())
        slots = max(-(-n // self.slot), 1)
        pad = slots * self.slot - S
        take = lambda x: F.pad(x, (0, max(pad, 0)))[..., : slots * self.slot]  # noqa: E731
        index = take(order)
        member = take(free.gather(-1, order)) & (torch.arange(slots * self.slot, device=obs.keys.device) < S)
        gather = lambda x: x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
        keys, values = gather(obs.keys.float()), gather(obs.values.float())
        relevance = mass.gather(-1, index.clamp_max(S - 1)) * member
        positions = obs.positions.gather(-1, index.clamp_max(S - 1))
        attn, lse, q = _probe(obs, self.probes)  # [B, Hkv, U, S], [B, Hkv, U], [B, Hkv, U, D]
        attn = attn.gather(-1, index[:, :, None].expand(-1, -1, attn.shape[2], -1)) * member[:, :, None]
        beta = self.beta * (mass * free).sum(-1) / free.sum(-1).clamp_min(1)  # [B, Hkv]
        levels = []
        depth = self.slot.bit_length() - 1
        for level in range(depth + 1):
            size = self.slot >> level
            group = lambda x: x.unflatten(2, (slots * (1 << level), size))  # noqa: E731
            m = group(member.float())
            count = m.sum(-1)
            k_mean = (group(keys) * m[..., None]).sum(-2) / count.clamp_min(1)[..., None]
            norms = (group(keys).norm(dim=-1) * m).sum(-1) / count.clamp_min(1)
            hbar = k_mean.norm(dim=-1) / (norms + 1e-6)
            log_w = (count * hbar.pow(2)).clamp_min(1).minimum(count.clamp_min(1)).log()
            r = group(relevance)
            w = (r + beta[..., None, None]) * m
            v_mean = (group(values) * w[..., None]).sum(-2) / w.sum(-1).clamp_min(1e-30)[..., None]
            pos = (group(positions.float()) * m).sum(-1) / count.clamp_min(1)
            if size == 1:
                err = torch.zeros_like(count)  # a single token is its own prototype: no distortion
            else:
                err = r.sum(-1) * _distortion(attn, lse, q, values, k_mean, v_mean, log_w, obs.scale, slots << level)
            best = (r + (1 - m) * -1.0).argmax(-1)  # the most relevant member, for the unmerged control
            levels.append({"count": count, "key": k_mean, "value": v_mean, "position": pos.round().long(),
                           "log_w": log_w, "err": err, "relevance": r.sum(-1), "index": index.unflatten(2, (-1, size)),
                           "best": best})
        return {"levels": levels, "slots": slots}

    def _allocate(self, trees: list[dict], floor: Tensor, max_pages: Tensor, page_size: int) -> list[list[Tensor]]:
        """The greedy of step 6, row by row: chosen[layer][level] [B, Hkv, nodes] True at each node kept."""
        L, B, Hkv = floor.shape
        chosen = [[torch.zeros(lv["count"].shape, dtype=torch.bool) for lv in t["levels"]] for t in trees]
        err = [[lv["err"].cpu().tolist() for lv in t["levels"]] for t in trees]
        count = [[lv["count"].cpu().long().tolist() for lv in t["levels"]] for t in trees]
        rel = [t["levels"][0]["relevance"].cpu().tolist() for t in trees]
        for b in range(B):
            held = [[int(floor[i, b, h]) for h in range(Hkv)] for i in range(L)]
            limit = int(max_pages[b])
            pages = sum(-(-x // page_size) for row in held for x in row)

            def grow(i, h, cost):  # the pages one head's growth by ``cost`` entries adds
                return -(-(held[i][h] + cost) // page_size) - -(-held[i][h] // page_size)

            def push_split(heap, i, h, level, s):
                if level + 1 >= len(err[i]) or count[i][level][b][h][s] < 2:
                    return
                kids = [c for c in (2 * s, 2 * s + 1) if count[i][level + 1][b][h][c] > 0]
                gain = err[i][level][b][h][s] - sum(err[i][level + 1][b][h][c] for c in kids)
                cost = len(kids) - 1
                heapq.heappush(heap, (-gain / cost if cost else -float("inf"), cost, (i, h, level, s)))

            roots = [(i, h, s) for i in range(L) for h in range(Hkv) for s in range(trees[i]["slots"])
                     if count[i][0][b][h][s] > 0]
            heap = []
            if len(roots) <= limit * page_size - sum(map(sum, held)):  # the singleton floor: every slot's root
                heap = [(-float("inf"), 1, (i, h, -1, s)) for i, h, s in roots]
            else:  # not every slot fits: coverage where it gains most
                heap = [(-(_DROPPED * rel[i][b][h][s] - err[i][0][b][h][s]), 1, (i, h, -1, s)) for i, h, s in roots]
            heapq.heapify(heap)
            while heap:
                _, cost, (i, h, level, s) = heapq.heappop(heap)
                if pages + grow(i, h, cost) > limit:
                    continue
                pages += grow(i, h, cost)
                held[i][h] += cost
                if level < 0:  # coverage: the slot's root
                    chosen[i][0][b, h, s] = True
                    push_split(heap, i, h, 0, s)
                    continue
                chosen[i][level][b, h, s] = False
                for c in (2 * s, 2 * s + 1):
                    if count[i][level + 1][b][h][c] > 0:
                        chosen[i][level + 1][b, h, c] = True
                        push_split(heap, i, h, level + 1, c)
        return chosen

    def _entries(self, observations, trees, chosen, pinned):
        """The kept mask (pinned tokens and single-token nodes, as the original tokens) and the new entries of the
        chosen nodes of several tokens, as ``prototypes`` returns them."""
        kept, new = pinned.clone(), []
        for i, tree in enumerate(trees):
            parts = {k: [] for k in ("key", "value", "position", "log_w", "several")}
            for level, sel in zip(tree["levels"], chosen[i]):
                sel = sel.to(pinned.device)
                several = sel & (level["count"] > 1)
                member = level["index"][..., 0]  # a node's members come first in it
                if not self.merged:  # the most relevant member stands, unweighted, for every chosen node
                    several, member = torch.zeros_like(several), level["index"].gather(
                        -1, level["best"][..., None])[..., 0]
                single = sel & ~several
                kept[i] |= torch.zeros_like(kept[i]).scatter_reduce(-1, member.clamp_max(kept.shape[-1] - 1), single,
                                                                   "amax")
                for k in ("key", "value", "position", "log_w"):
                    parts[k].append(level[k])
                parts["several"].append(several)
            several = torch.cat(parts["several"], 2)
            order = (~several).long().argsort(dim=-1, stable=True)  # each head's prototypes first
            pick = lambda x: x.gather(2, order if x.dim() == 3 else order[..., None].expand_as(x))  # noqa: E731
            new.append(([pick(torch.cat(parts[k], 2)) for k in ("key", "value", "position", "log_w")],
                        several.sum(-1)))
        E = max(max(int(c.max()) for _, c in new), 1)
        cut = lambda x: F.pad(x[:, :, :E], (0, 0) * (x.dim() - 3) + (0, max(E - x.shape[2], 0)))  # noqa: E731
        keys, values, positions, log_w = (torch.stack([cut(parts[j]) for parts, _ in new]) for j in range(4))
        counts = torch.stack([c for _, c in new])
        live = torch.arange(E, device=counts.device) < counts[..., None]
        return kept, keys, values, positions, log_w * live, counts


def _probe(obs: Observation, probes: int):
    """The last ``probes`` window queries' attention [B, Hkv, U, S] (U = group x probes), its log-partition
    [B, Hkv, U] and the queries [B, Hkv, U, D], each KV head's GQA group stacked."""
    B, Hkv, S, D = obs.keys.shape
    Hq = obs.queries.shape[1]
    last = obs.query_positions.topk(min(probes, obs.query_positions.shape[1]), dim=-1).indices  # [B, W]
    positions = obs.query_positions.gather(1, last)
    W = last.shape[1]
    queries = obs.queries.gather(2, last[:, None, :, None].expand(B, Hq, W, D))
    q = queries.float().reshape(B, Hkv, (Hq // Hkv) * W, D)
    seen = (positions >= 0)[:, None, None, :].expand(B, Hkv, Hq // Hkv, W).reshape(B, Hkv, -1)
    qp = positions[:, None, None, :].expand(B, Hkv, Hq // Hkv, W).reshape(B, Hkv, -1)
    logits = torch.einsum("bhud,bhsd->bhus", q, obs.keys.float()) * obs.scale
    if obs.log_weights is not None:
        logits = logits + obs.log_weights[:, :, None, :]
    visible = obs.valid[:, :, None, :] & (obs.positions[:, :, None, :] <= qp[..., None]) & seen[..., None]
    if obs.window > 0:
        visible = visible & (qp[..., None] - obs.positions[:, :, None, :] < obs.window)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    attn = (logits - lse[..., None].nan_to_num(0.0, neginf=0.0)).exp().nan_to_num(0.0)
    return attn, lse, q * seen[..., None]


def _distortion(attn, lse, q, values, k_mean, v_mean, log_w, scale, nodes, chunk_bytes: int = 1 << 24) -> Tensor:
    """Step 3's distortion [B, Hkv, nodes] of each node's prototype over the probe queries, a chunk of nodes at a
    time (each node's is its own: a chunk bounds the [B, Hkv, U, nodes, D] products, hundreds of MB at 4k x 4)."""
    B, Hkv, U, S = attn.shape
    a = attn.unflatten(-1, (nodes, S // nodes))  # [B, Hkv, U, nodes, size]
    v = values.unflatten(2, (nodes, S // nodes))  # [B, Hkv, nodes, size, D]
    step = max(1, chunk_bytes // (4 * B * Hkv * U * v.shape[-1]))
    chunks = [slice(i, i + step) for i in range(0, nodes, step)]
    return torch.cat([_node_distortion(a[:, :, :, n], lse, q, v[:, :, n], k_mean[:, :, n], v_mean[:, :, n],
                                       log_w[:, :, n], scale) for n in chunks], -1)


def _node_distortion(a, lse, q, values, k_mean, v_mean, log_w, scale) -> Tensor:
    """The distortion of a chunk of nodes: a [B, Hkv, U, n, size] the probes' attention to their members."""
    Z = a.sum(-1)  # [B, Hkv, U, nodes]
    M = torch.einsum("bhuns,bhnsd->bhund", a, values)
    logit = torch.einsum("bhud,bhnd->bhun", q, k_mean) * scale + log_w[:, :, None]
    Zt = (logit - lse[..., None]).exp().nan_to_num(0.0, posinf=0.0) * (Z > 0)
    Du = (Z - Zt).pow(2) / (Z.pow(2) + _EPS) + (M - Zt[..., None] * v_mean[:, :, None]).pow(2).sum(-1) / (
        M.pow(2).sum(-1) + _EPS)
    return (Z * Du).sum(2) / Z.sum(2).clamp_min(1e-30)
