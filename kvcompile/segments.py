"""Segments of a prompt: the steps (reasoning steps, tool calls and their observations) a step-level method keeps or
evicts as units (``methods.step_units``).

``prefill(..., segments=...)`` and ``generate(..., segments=...)`` take them in the token positions of the prompt
they read (0 = its first real token), as a list of ``(start, end)`` spans (end exclusive; the gaps between spans are
segments too), a list of boundaries (the positions where a segment starts), or a rule over the tokenized text,
which needs ``tokenizer=``:

* ``"blank-lines"``: a segment starts after every blank line (``"\\n\\n"``, spaces between allowed);
* ``"tool-calls"``: a segment starts at every tool-call marker (``TOOL_CALL_MARKERS``).

``boundaries`` turns any of them into the [B, K] start positions the cache records (``PagedKVCache.mark_segments``);
methods read each position's segment index (``methods.sources.Segments``).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

RULES = ("blank-lines", "tool-calls")
TOOL_CALL_MARKERS = ("<tool_call>", "Action:", "Tool call:")
_PATTERNS = {"blank-lines": r"\n[ \t]*\n\s*", "tool-calls": "|".join(re.escape(m) for m in TOOL_CALL_MARKERS)}


def boundaries(segments, input_ids: Tensor, real: Tensor, tokenizer=None) -> Tensor:
    """[B, K] int64 segment starts (relative to each row's first real token; rows padded with ``-1``) for the
    prompt ``input_ids`` [B, T] with real-token mask ``real`` [B, T]. Bad input raises ``ValueError`` naming it."""
    lengths = real.sum(1).tolist()
    if isinstance(segments, str):
        return _padded([by_rule(segments, ids[r.bool()].tolist(), tokenizer) for ids, r in zip(input_ids, real)])
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ValueError("segments must be a non-empty list of (start, end) spans or of boundary positions, or a "
                         f"rule ({', '.join(map(repr, RULES))}); got {segments!r}")
    starts = _spans(segments) if all(isinstance(s, (list, tuple)) for s in segments) else _starts(segments)
    shortest = min(lengths)
    if starts[-1] > shortest:
        raise ValueError(f"segments reach position {starts[-1]}, past the {shortest} tokens of the shortest prompt "
                         "row (positions count each row's real tokens from 0)")
    return torch.tensor([sorted({0, *starts})] * len(lengths), dtype=torch.long)


def _spans(spans) -> list[int]:
    starts, last = [], 0
    for span in spans:
        if len(span) != 2 or not all(_is_int(x) for x in span):
            raise ValueError(f"a segment span must be (start, end) ints, got {span!r}")
        start, end = int(span[0]), int(span[1])
        if not 0 <= start < end:
            raise ValueError(f"a segment span needs 0 <= start < end, got ({start}, {end})")
        if start < last:
            raise ValueError(f"segment spans must be sorted and not overlap: ({start}, {end}) starts before {last}")
        starts += [start, end]
        last = end
    return sorted(set(starts))


def _starts(positions) -> list[int]:
    if not all(_is_int(p) for p in positions):
        raise ValueError(f"segment boundaries must be ints, or spans (start, end); got {positions!r}")
    positions = [int(p) for p in positions]
    if positions[0] < 0 or any(b <= a for a, b in zip(positions, positions[1:])):
        raise ValueError(f"segment boundaries must be strictly increasing positions >= 0, got {positions}")
    return positions


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, Tensor) and x.dim() == 0 and \
        not x.is_floating_point()


def by_rule(rule: str, ids: list[int], tokenizer) -> list[int]:
    """Segment starts of one row's token ``ids`` by ``rule`` (``RULES``): a blank line ends a segment (the next
    segment starts at the first token after it); a tool-call marker starts one (at the token holding its first
    character)."""
    if rule not in RULES:
        raise ValueError(f"unknown segments rule {rule!r}; known: {', '.join(RULES)}")
    if tokenizer is None:
        raise ValueError(f"segments={rule!r} splits the tokenized text: pass tokenizer= as well")
    pieces = [tokenizer.decode([i]) for i in ids]
    token_at = [t for t, piece in enumerate(pieces) for _ in piece]  # the token holding each character
    text = "".join(pieces)
    starts = {0}
    for m in re.finditer(_PATTERNS[rule], text):
        at = m.end() if rule == "blank-lines" else m.start()
        if at < len(text):
            starts.add(token_at[at])
    return sorted(starts)


def _padded(rows: list[list[int]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def segment_of(starts: Tensor, length: int) -> Tensor:
    """[B, length] the segment index of every position, numbered from 0 in position order: how many of a row's
    ``starts`` [B, K] (absolute, -1 = none) are at or before it, less one when a segment starts at 0."""
    pos = torch.arange(length, device=starts.device)
    count = ((starts[:, None, :] <= pos[None, :, None]) & (starts[:, None, :] >= 0)).sum(-1)
    return count - (starts == 0).any(-1, keepdim=True).long()
