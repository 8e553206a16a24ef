"""The cache: ragged per-head pages (``paged``) and the observation ring (``ring``)."""

from .paged import MIN_WIDTH, PagedKVCache, Step
from .ring import QueryRing

__all__ = ["MIN_WIDTH", "PagedKVCache", "QueryRing", "Step"]
