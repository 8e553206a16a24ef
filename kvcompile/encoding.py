"""Page formats whose rows only compression can write: each row is encoded against tables that the compression
builds from the whole prompt, so the generic path (score, evict, encode row by row) cannot store them. Such a format
registers here the module that plans its compression; ``compress`` looks it up by the cache's format.

An encoder is any object with ``plan(cache, layers, budget_bytes) -> Plan`` (every held token encoded within the
budget) and ``check_fits(cache, held, budget_bytes, budget)`` (raise before a prefill writes anything when what the
rows need before any refinement exceeds ``budget_bytes``; ``budget`` names the budget in the message).
"""

from __future__ import annotations

from . import anchoring

ENCODERS = {"anchor2": anchoring}


def encoder_of(page_format: str | None):
    """The encoder of ``page_format``, or None for a format whose rows encode one by one."""
    return ENCODERS.get(page_format)
