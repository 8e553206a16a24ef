"""Scorers and allocators, registered by name. One file per method; see ``base`` for the contract."""

from . import adakv, knorm, pyramidkv, random_eviction, snapkv, streaming_llm, uniform  # noqa: F401  (registration)
from .base import ALLOCATORS, SCORERS, Allocator, Observation, Scorer

__all__ = ["ALLOCATORS", "SCORERS", "Allocator", "Observation", "Scorer"]
