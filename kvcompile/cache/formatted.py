"""The format pool of the paged cache: entries stored in a page format (``kernels.formats``), beside the model-dtype
pool where new tokens are written.

Layout (one pool for all layers, as the model-dtype one)::

    fmt_k, fmt_v            : [N', P, W]  codes of keys and values (uint8, float8 or a narrow float)
    fmt_k_meta, fmt_v_meta  : [N', P, M]  their scales and zero points (M = 0 for a plain cast; [N', 1, M]
                                          for a page-local codec: one row per page)
    fmt_pos                 : [N', P]     original positions
    fmt_table               : [L, B, Hkv, W'] logical format page i of head (l, b, h) -> page of this pool
    fmt_lengths             : [L, B, Hkv] entries head (l, b, h) holds in this pool
    fmt_channels            : [L, B, Hkv, W] the key channels each head keeps, for a format that drops some
                                          (``kernels.pruned.PrunedCodec``; W = 0 for any other): what its pages list
    fmt_basis               : [L, 2, Hkv, 2D + 3, D] the model's basis of latent rows (``kernels.latent``;
                                          [L, 0, ...] for any other format), set with the format
    fmt_anchors, fmt_residuals : an anchored format's per-sequence tables (``anchored``; empty for any other format)

A head's entries, in logical order, are its format entries then its model-dtype entries (``lengths``), so the plans
of every method index one list (``dense``). The pool is written only by ``keep``: compression encodes the kept
tokens once (entries already stored move as bytes where the codec is row-local, and are decoded and encoded again
with their new page where it is page-local), and lays the pool out anew, exactly
the pages held plus the scratch page 0 (and a spare page when it holds less than one). New tokens always go to the
model-dtype pool, so quantization never runs inside a program.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import latent, reference
from ..kernels.anchored import AnchorCodec
from ..kernels.formats import PrunedCodec, codec_of, encode_pool, get_format
from ..kernels.latent import LatentCodec
from ..plan import DTYPE_FORMAT, STORED_FORMAT, Plan
from ..signature import FORMAT_POOL
from .anchored import AnchorTables
from .precision import PrecisePositions

MIN_PAGES = 2  # pages of a format pool at least: the scratch page and a spare
FORMAT_TENSORS = tuple(i.name for i in FORMAT_POOL)


class FormatPool(PrecisePositions, AnchorTables):
    """Format-pool state and moves of ``PagedKVCache`` (mixed into it)."""

    def _empty_format_pool(self, batch_size: int) -> None:
        """An empty format pool: its scratch page and one spare (a pool is never one page, which a compiled or
        exported program would specialise on), none without a format (attention skips it: ``FormatPages.empty``)."""
        L, Hkv, P, D, dev = self.num_layers, self.num_kv_heads, self.page_size, self.head_dim, self.device
        N = 0 if self.page_format is None else MIN_PAGES
        for name in ("k", "v"):
            codec, zeros = self._codec("key" if name == "k" else "value"), torch.zeros(N, P, D, device=dev)
            if isinstance(codec, (LatentCodec, AnchorCodec)):  # rows against a table: nothing to encode without it
                codes, meta = codec.zeros(N, P, D, device=dev)
            else:
                codes, meta = ((torch.zeros(N, P, 0, dtype=torch.uint8, device=dev),) * 2 if codec is None else
                               encode_pool(codec, zeros, torch.zeros(N, P, dtype=torch.bool, device=dev)))
            setattr(self, f"fmt_{name}", codes.new_zeros(codes.shape))
            setattr(self, f"fmt_{name}_meta", meta.new_zeros(meta.shape))
        self.fmt_pos = torch.zeros(N, P, dtype=torch.int32, device=dev)
        self.fmt_table = torch.zeros(L, batch_size, Hkv, 2, dtype=torch.int32, device=dev)
        self.fmt_lengths = torch.zeros(L, batch_size, Hkv, dtype=torch.int32, device=dev)
        key = self._codec("key")
        kept = key.kept(D) if isinstance(key, PrunedCodec) else 0
        self.fmt_channels = torch.arange(kept, dtype=torch.int16, device=dev).expand(L, batch_size, Hkv, -1).clone()
        self._empty_anchor_tables(batch_size)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the model-dtype pool; the format pool only follows the device (its dtypes are its
        format, which ``codec_of`` reads back)."""
        saved = {name: getattr(self, name) for name in (*FORMAT_TENSORS, "fmt_channels")}
        super()._apply(fn, recurse)
        for name, tensor in saved.items():
            setattr(self, name, tensor.to(self.k_pages.device))
        return self

    def set_format(self, page_format: str | None, basis: Tensor | None = None) -> None:
        """Store later compressions in ``page_format`` (a ``fork`` to a recipe of another format); refused while
        entries are stored in the current one. ``basis``: the model's latent basis, which a latent format needs
        (``kernels.latent.model_basis``)."""
        if page_format != self.page_format and self.format_used:
            raise ValueError(f"this cache holds {self.page_format} pages; a recipe storing "
                             f"{page_format or 'the model dtype'} must prefill on its own")
        fmt = None if page_format is None else get_format(page_format)
        if fmt is not None:
            fmt.token_bytes(self.head_dim)  # an unknown name or a head dim it cannot pack raises
        latent = fmt is not None and fmt.latent
        if latent and basis is None:
            raise ValueError(f"{page_format} pages are stored in a basis calibrated for the model, and none was given "
                             "(kvcompile.apply calibrates it)")
        L, Hkv, D = self.num_layers, self.num_kv_heads, self.head_dim
        self.fmt_basis = (basis.to(self.device, torch.float32) if latent else
                          torch.zeros(L, 0, Hkv, 2 * D + 3, D, device=self.device))
        if page_format != self.page_format or not self.fmt_k.numel():
            self.page_format = page_format
            self._empty_format_pool(self.batch_size)

    def _codec(self, part: str):
        return None if self.page_format is None else getattr(get_format(self.page_format), part)

    def held(self) -> Tensor:
        """[L, B, Hkv] entries each head holds, in both pools."""
        return self.lengths + self.fmt_lengths

    def format_pages(self, layer: int) -> reference.FormatPages:
        """Layer ``layer``'s view of the format pool, as attention reads it."""
        return reference.FormatPages.of_layer([getattr(self, name) for name in FORMAT_TENSORS], layer)

    @property
    def format_used(self) -> bool:
        """Whether any head holds entries in the format pool (a host sync: compression paths only)."""
        return bool(self.fmt_lengths.any())

    def _logical(self, layer: int, dense):
        """``dense``'s views (the model-dtype pool) preceded, per head, by its decoded format entries."""
        if not self.format_used:
            return dense
        stored = self.format_pages(layer).dense(self.head_dim, self.dtype)
        n, S1 = self.fmt_lengths[layer].long()[..., None], stored[0].shape[2]
        S = S1 + dense[0].shape[2]
        j = torch.arange(S, device=self.device)
        src = torch.where(j < n, j, S1 + j - n).clamp_max(S - 1)  # [B, Hkv, S]
        keys, values, positions, _ = (torch.cat([a, b], 2).gather(2, src[..., None].expand(-1, -1, -1, a.shape[-1])
                                                                  if a.dim() == 4 else src)
                                      for a, b in zip(stored, dense))
        return keys, values, positions, j < (n[..., 0] + self.lengths[layer])[..., None]

    def demote(self, precise_recent: int, shrink: bool = True, channels: Tensor | None = None,
               anchors: int = 0) -> None:
        """Store every held entry in the page format except each row's ``precise_recent`` newest tokens and its
        anchor pages (``precise``), which stay in the model's dtype; nothing is evicted. What a format recipe that
        evicts nothing does when it compresses, and, while decoding, to the tokens that left its recent window
        (``CompressedModel._advance``). ``channels``: the key channels each head keeps in a format that drops some
        (``Plan.channels``; None: those it keeps now)."""
        held = self.held().long()
        keep = torch.arange(max(int(held.max()), 1), device=self.device).expand(*held.shape, -1)
        recent = self.precise(precise_recent, anchors)
        formats = torch.full_like(keep, STORED_FORMAT).masked_fill(
            recent.gather(-1, keep.clamp_max(recent.shape[-1] - 1)), DTYPE_FORMAT)
        self.keep(Plan(keep, held, formats=formats, channels=channels), shrink=shrink)

    def _keep_formatted(self, plan: Plan) -> Plan:
        """Lay the format pool out anew with the entries ``plan`` keeps in the page format (stored ones moved as
        bytes, model-dtype ones encoded, then a formatted plan's ``new`` entries, encoded) and return the plan of
        what stays in the model-dtype pool, in that pool's own indices (an anchored plan: ``_keep_anchored``)."""
        if plan.anchored is not None:
            return self._keep_anchored(plan)
        P, D = self.page_size, self.head_dim
        n1 = self.fmt_lengths.long()[..., None]
        live = torch.arange(plan.keep.shape[-1], device=self.device) < plan.counts[..., None]
        stored = plan.keep < n1
        to_format = stored if plan.formats is None else plan.formats == STORED_FORMAT
        if bool((live & stored & ~to_format).any()):
            raise NotImplementedError("the plan moves stored entries back to the model dtype; formats only demote")
        if self.page_format is None and bool((live & to_format).any()):
            raise ValueError("this cache has no page format, but the plan stores entries in one")
        if plan.channels is not None:  # every stored entry, moved ones too, keeps the channels chosen now
            self.fmt_channels = plan.channels.to(torch.int16)
        mine, theirs = live & to_format, live & ~to_format
        heads = torch.arange(plan.counts.numel(), device=self.device).view(*plan.counts.shape, 1)
        heads, index = heads.expand_as(plan.keep), mine.long().cumsum(-1) - 1
        rows_f = reference.rows_of(self.fmt_table, plan.keep.minimum(n1 - 1).clamp_min(0), P)
        rows_d = reference.rows_of(self.page_table, (plan.keep - n1).clamp_min(0), P)
        moved, fresh = mine & stored, mine & ~stored
        entries = [(heads[moved], index[moved], *self._moved_rows(rows_f[moved])),
                   (heads[fresh], index[fresh],
                    *self._encode(self.k_pages.view(-1, D)[rows_d[fresh]], self.v_pages.view(-1, D)[rows_d[fresh]],
                                  heads[fresh], self.page_pos.view(-1)[rows_d[fresh]]),
                    self.page_pos.view(-1)[rows_d[fresh]])]
        counts, new = mine.sum(-1), plan.new
        if plan.formats is not None and new is not None:  # a formatted plan stores its new entries too
            e = torch.arange(new.positions.shape[-1], device=self.device)
            sel = e < new.counts[..., None]
            heads_e = torch.arange(counts.numel(), device=self.device).view(*counts.shape, 1).expand(sel.shape)
            entries.append((heads_e[sel], (counts[..., None] + e).expand(sel.shape)[sel],
                            *self._encode(new.keys[sel], new.values[sel], heads_e[sel], new.positions[sel]),
                            new.positions[sel]))
            counts, new = counts + new.counts.long(), None
        self._lay_out(entries, counts)
        keep_d = torch.where(theirs, plan.keep - n1, torch.iinfo(torch.int32).max).sort(-1).values
        return Plan(keep_d.clamp_max(max(int(self.lengths.max()) - 1, 0)), theirs.sum(-1), new=new)

    def _fmt_rows(self) -> tuple[Tensor, ...]:
        """The pool's per-page tensors (codes, metadata, positions), by their names in ``signature.FORMAT_POOL``."""
        return tuple(getattr(self, i.name) for i in FORMAT_POOL if not i.per_layer)

    def _parts(self):
        """(codes, meta, codec) of keys, then of values."""
        return ((self.fmt_k, self.fmt_k_meta, self._codec("key")), (self.fmt_v, self.fmt_v_meta, self._codec("value")))

    def _moved_rows(self, rows: Tensor) -> tuple[Tensor, ...]:
        """What entries at flat rows ``rows`` of the format pool carry to their new place: their bytes (codes,
        meta) for a row-local codec, their decoded fp32 rows (and no meta) for a page-local one."""
        out = []
        for codes, meta, codec in self._parts():
            if codec.page_local:
                pages = meta[rows // self.page_size]  # [n, 1, M]: each row's page metadata
                decoder = codec_of(codes, meta, self.head_dim)
                out += [decoder.decode(codes.flatten(0, 1)[rows][:, None], pages, torch.float32)[:, 0], None]
            else:
                out += [codes.flatten(0, 1)[rows], meta.flatten(0, 1)[rows]]
        return (*out, self.fmt_pos.flatten()[rows])

    def _encode(self, keys: Tensor, values: Tensor, heads: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """Fresh entries as ``_moved_rows`` gives moved ones: encoded rows, or fp32 rows for a page-local codec.
        ``heads``: each entry's flat (layer, row, KV head) index, ``positions``: its position (what latent rows
        need: their head's basis, and the rotation that takes a key back to before RoPE)."""
        out = []
        for part, (x, (_, _, codec)) in enumerate(zip((keys, values), self._parts())):
            if isinstance(codec, LatentCodec):
                B, Hkv = self.batch_size, self.num_kv_heads
                out += latent.encode_heads(x, self.fmt_basis[:, part], codec.group_of(self.head_dim),
                                           heads // (B * Hkv), heads % Hkv, positions)
            else:
                out += [x.float(), None] if codec.page_local else [*codec.encode(x.float())]
        return tuple(out)

    def _lay_out(self, entries, counts: Tensor) -> None:
        """A new format pool holding, for each head, ``counts`` entries on consecutive pages (heads in (layer,
        row, head) order, after the scratch page); ``entries``: (head, index in head, k codes, k meta, v codes,
        v meta, positions) of every one of them (for a page-local codec: fp32 rows and None, encoded here a page
        at a time once every row is in place)."""
        P, D = self.page_size, self.head_dim
        pages = (counts + P - 1) // P
        base = 1 + pages.flatten().cumsum(0) - pages.flatten()  # first page of each head
        width = max(int(pages.max()), 2)
        j = torch.arange(width, device=self.device)
        self.fmt_table = torch.where(j < pages[..., None], base.view(*pages.shape, 1) + j, 0).to(torch.int32)
        self.fmt_lengths = counts.to(torch.int32)
        total = max(1 + int(pages.sum()), MIN_PAGES)
        local = [codec.page_local for _, _, codec in self._parts()]
        fresh = [t.new_zeros(total, *t.shape[1:]) for t in self._fmt_rows()]
        dense = [torch.zeros(total, P, D, device=self.device) if on else None for on in local]
        valid = torch.zeros(total * P, dtype=torch.bool, device=self.device)
        for head, index, *values in entries:
            rows = (base[head] + index // P) * P + index % P
            valid[rows] = True
            for i, (pool, value) in enumerate(zip(fresh, values)):
                target = dense[i // 2] if i < 4 and local[i // 2] else pool
                if value is not None:
                    target.flatten(0, 1)[rows] = value.to(target.dtype)
        for i, (rows_f32, (_, _, codec)) in enumerate(zip(dense, self._parts())):
            if rows_f32 is not None:
                extra = (self._page_channels(pages, total),) if isinstance(codec, PrunedCodec) else ()
                fresh[2 * i], fresh[2 * i + 1] = codec.encode_pages(rows_f32, valid.view(total, P), *extra)
        self.fmt_k, self.fmt_k_meta, self.fmt_v, self.fmt_v_meta, self.fmt_pos = fresh

    def _page_channels(self, pages: Tensor, total: int) -> Tensor:
        """[total, W] the key channels each page of a new layout keeps: its head's (``fmt_channels``), the first W
        for the scratch and spare pages."""
        W = self.fmt_channels.shape[-1]
        out = torch.arange(W, device=self.device).repeat(total, 1)
        owner = torch.repeat_interleave(torch.arange(pages.numel(), device=self.device), pages.flatten())
        out[1 : 1 + owner.numel()] = self.fmt_channels.flatten(0, 2)[owner].long()
        return out
