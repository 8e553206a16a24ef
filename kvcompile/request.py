"""What one request leaves between a ``CompressedModel``'s calls, in one object: the model holds it as
``request``, its step code and these methods are its only writers, and ``fork`` starts from a ``copy``. The cache
holds the tokens; this holds what the model must remember about them (what the budget counts, what is still to
compress, the decode schedule's state) and whether a call stopped half way."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .schedule import DecodeCompressor


@dataclass
class RequestState:
    """The state ``reset`` clears. Empty (every field at its default) until a prompt is read."""

    context_tokens: Tensor | None = None  # [B] tokens the budget is measured against
    decoder: DecodeCompressor | None = None  # the decode schedule's state, from the first decode step on
    query_aware: bool | None = None  # how the last compression was made (``cache_stats``)
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (ids, real) read since the last compression
    deferred: bool = False  # a prefill(compress=False) left a compression for later: queries are still observed
    decoded: int = 0  # tokens every row decoded since its last prompt or compression: what ``rewind`` may take back
    torn: bool = False  # a call stopped half way (an interrupt, an error mid-step): only ``reset`` mends it

    def start(self, rows: int, device: torch.device) -> None:
        """A new request of ``rows`` sequences, nothing read yet; ``torn`` stays, as the call starting it is under
        way."""
        self.context_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.decoder = self.query_aware = None
        self.pending, self.deferred, self.decoded = [], False, 0

    @contextlib.contextmanager
    def changing(self):
        """Around every change a call makes: if the block does not finish, the request is torn until ``reset``."""
        if self.torn:
            raise RuntimeError("the last call stopped half way through a step (interrupted?): call reset(); "
                               "generate() resets by itself")
        self.torn = True
        yield
        self.torn = False

    def copy(self, decoder_layers=None) -> RequestState:
        """The state a ``fork`` starts from, with tensors and lists of its own; not torn. ``decoder_layers``: the
        programs' layers, shared by the copied decode schedule's state (None: that state is dropped, and the fork's
        own schedule starts again at its first decode step)."""
        decoder = None if decoder_layers is None or self.decoder is None else \
            copy.deepcopy(self.decoder, memo={id(decoder_layers): decoder_layers})
        return RequestState(self.context_tokens.clone(), decoder, self.query_aware, list(self.pending), self.deferred,
                            self.decoded)
