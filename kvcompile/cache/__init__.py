"""The cache: ragged per-head pages (``paged``), their pool (``pages``), byte accounting (``accounting``) and the
observation ring (``ring``)."""

from .paged import MIN_WIDTH, PagedKVCache, Step
from .ring import QueryRing

__all__ = ["MIN_WIDTH", "PagedKVCache", "QueryRing", "Step"]
