"""What ``budget=`` means: a fraction of the context's KV bytes, average tokens per KV head, or a byte size.

Every form resolves, per sequence, to a number of bytes the cache may hold after compression, page rounding
included. Bytes of per-token metadata (positions, page tables) are reported separately by the cache.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
MAX_TOKENS = 2**40  # tokens per KV head; far above any context, far below int64 overflow of the byte counts
MAX_BYTES = 2**56
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMG]I?B|B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """A parsed budget. ``kind`` is "fraction", "tokens" or "bytes"; ``value`` is the number in that unit."""

    kind: str
    value: float

    @classmethod
    def parse(cls, budget) -> Budget:
        """Read ``0.25`` (fraction of the context), ``512`` (tokens per KV head) or ``"64MiB"`` (bytes per sequence)."""
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool) or budget is None:
            raise ValueError(f"budget must be a fraction in (0, 1], a token count or a size like '64MiB', "
                             f"got {budget!r}")
        if isinstance(budget, int):
            if not 0 < budget <= MAX_TOKENS:
                raise ValueError(
                    f"budget as a token count must be a positive int (tokens per KV head) of at most {MAX_TOKENS}, "
                    f"got {budget}"
                )
            return cls("tokens", float(budget))
        if isinstance(budget, float):
            if math.isnan(budget):
                raise ValueError("budget is NaN; give a fraction in (0, 1], a token count or a size like '64MiB'")
            if not 0.0 < budget <= 1.0:
                raise ValueError(
                    f"budget as a float is a fraction of the context's KV bytes and must be in (0, 1], got {budget}; "
                    "for a token count pass an int, for a size a string such as '64MiB'"
                )
            return cls("fraction", budget)
        if isinstance(budget, str):
            m = _SIZE.match(budget)
            if not m:
                raise ValueError(f"cannot read budget {budget!r}: expected a size such as '64MiB', '1.5GB' or '4096B'")
            size = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
            if size < 1:
                raise ValueError(f"budget {budget!r} is smaller than one byte")
            if size > MAX_BYTES:
                raise ValueError(f"budget {budget!r} is larger than the {MAX_BYTES} bytes kvcompile can count")
            return cls("bytes", size)
        raise TypeError(f"budget must be a float, int or str, got {type(budget).__name__}")

    @property
    def is_full(self) -> bool:
        """True for ``budget=1.0``: keep everything, compress nothing."""
        return self.kind == "fraction" and self.value >= 1.0

    def bytes_per_sequence(self, context_tokens: int, num_layers: int, num_kv_heads: int, token_bytes: int) -> int:
        """Bytes one sequence may hold. ``token_bytes`` is K plus V of one token of one KV head. ``budget=1.0``
        keeps everything: no bound (page rounding, a page format's residual window in the model's dtype)."""
        if self.is_full:
            return MAX_BYTES
        if self.kind == "fraction":
            return int(self.value * context_tokens * num_layers * num_kv_heads * token_bytes)
        if self.kind == "tokens":
            return int(self.value * num_layers * num_kv_heads * token_bytes)
        return int(self.value)

    def __str__(self) -> str:
        if self.kind == "fraction":
            return f"{self.value:g}"
        if self.kind == "tokens":
            return f"{int(self.value)} tokens/head"
        return f"{int(self.value)} B"
