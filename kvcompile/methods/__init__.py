"""Scorers and allocators, registered by name. One file per method; see ``base`` for the contract."""

from . import adakv, knorm, pyramidkv, random_eviction, snapkv, streaming_llm, uniform  # noqa: F401  (registration)
from . import (  # noqa: F401  (registration)
    compactor, criticalkv, expected_attention, finch, h2o, jacap, keydiff, kvcompose, kvgrad, kvzip, qfilter, tova,
    twinkv,
)
from . import capkv, cur, lagkv, leverage_score, noncausal_attention, observed_attention  # noqa: F401  (kvpress)
from . import catekv, certkv, contourkv, core, gracekv, page_entrokv, ripplekv, sgdkv  # noqa: F401  (registration)
from . import cam, growpage, h2o_decode, inertiakv, random_attention, snapkv_decode  # noqa: F401  (decode time)
from . import chunks, composed, lukv, per_layer, scorer_decode  # noqa: F401  (registration: kvpress's wrappers)
from . import duoattention, headwisekv, simlayerkv, streaming_heads, transactional  # noqa: F401  (registration: by structure)
from . import step_units  # noqa: F401  (registration: steps as units)
from . import dms, fastkvzip, kvpop, kvzap, restorekv  # noqa: F401  (registration: learned scorers)
from . import taskpress  # noqa: F401  (registration: quantization scales as scores)
from .base import ALLOCATORS, SCORERS, Allocator, Observation, Scorer

__all__ = ["ALLOCATORS", "SCORERS", "Allocator", "Observation", "Scorer"]
