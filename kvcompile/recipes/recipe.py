"""The ``Recipe`` record: which scorer and allocator, with which parameters, reproduce a method, and on what
evidence."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels.formats import get_format
from ..methods import ALLOCATORS, SCORERS
from ..methods.merging import ValueMerging
from ..schedule import DecodeSchedule

PROVENANCE = {  # the strongest evidence a recipe rests on
    "official-code": "the method's official implementation was read",
    "paper": "the full paper was read",
    "abstract": "the paper itself was not read: its abstract, at most a third-party summary; details inferred",
    "peer": "reproduces a peer library's implementation (kvpress, awslabs/keys_values)",
    "description": "inferred from a one-line description: no paper, code or summary was found",
    "control": "a baseline or control, no paper",
    "custom": "not a built-in recipe: no claim made",
}


@dataclass(frozen=True)
class Recipe:
    name: str
    scorer: str | None  # None: nothing is ever evicted
    allocator: str = "uniform"
    scorer_args: dict = field(default_factory=dict)
    allocator_args: dict = field(default_factory=dict)
    version: int = 1
    source: str = ""
    query_aware: bool = False
    decode: dict | None = None  # ``schedule.DecodeSchedule`` fields: compress while generating (None: never)
    provenance: str = "custom"  # a key of PROVENANCE
    inferred: str = ""  # what the recipe fills in beyond its evidence ("" = nothing)
    prefill_chunk: int | None = None  # prefill this many tokens at a time (``apply``'s default for this recipe)
    rerotate_keys: bool = False  # after compressing, move kept keys to contiguous positions (``kvcompile.rerotation``)
    format: str | None = None  # store what compression keeps in this page format (``kernels.formats``; None: dtype)
    precise_recent: int = 0  # with a format: the newest tokens stay in the model's dtype (KIVI's residual window;
    # while decoding, every precise_recent tokens, those older than the window move to the format:
    # ``CompressedModel._advance``)
    precise_anchors: int = 0  # with a format: every n-th page of positions stays in the model's dtype (Minima-KV)
    merge: dict | None = None  # ``methods.merging.ValueMerging`` fields: fold evicted values into kept ones (None: no)
    trained_for: str = ""  # the model whose trained weights the scorer reads (``kvcompile train``): it runs on that one
    adapter: dict | None = None  # LoRA weights ``{"method", "weights", "sha256"}`` merged into a copy of the model
    # before capture (``kvcompile.adapters``; None: the model as given)

    def __post_init__(self):
        if self.provenance not in PROVENANCE:
            raise ValueError(f"recipe {self.name!r}: provenance {self.provenance!r} is not one of {list(PROVENANCE)}")
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"recipe {self.name!r}: unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"recipe {self.name!r}: unknown allocator {self.allocator!r}; known: {sorted(ALLOCATORS)}")
        if self.format is not None and get_format(self.format).anchored and (
                self.scorer or self.precise_recent or self.precise_anchors or self.decode or self.merge):
            raise ValueError(f"recipe {self.name!r}: {self.format} pages hold every token, encoded against its "
                             "anchors when the prompt is compressed; no scorer, precise window, anchor pages, decode "
                             "schedule or merging goes with them")
        if self.merge is not None:
            self._check_merge()
        if self.precise_anchors and self.format is None:
            raise ValueError(f"recipe {self.name!r}: precise_anchors keeps anchor pages out of a page format; it "
                             "needs a format")
        if self.precise_recent and self.format is None:
            raise ValueError(f"recipe {self.name!r}: precise_recent keeps recent tokens out of a page format; it "
                             "needs a format")
        if (self.adapter is not None
                and not {"method", "weights"} <= set(self.adapter) <= {"method", "weights", "sha256"}):
            raise ValueError(f"recipe {self.name!r}: adapter needs 'method' and 'weights' (and may pin 'sha256'), got "
                             f"{sorted(self.adapter)}")
        if self.decode is not None:
            try:
                DecodeSchedule(**self.decode)
            except (TypeError, ValueError) as e:
                raise ValueError(f"recipe {self.name!r}: bad decode schedule: {e}") from e

    def _check_merge(self) -> None:
        """Merging folds values at a prefill compression: its parameters must be ValueMerging's, and a decode-time
        schedule (which would evict without merging) is refused."""
        try:
            ValueMerging(**self.merge)
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe {self.name!r}: bad merge parameters: {e}") from e
        if self.decode is not None:
            raise ValueError(f"recipe {self.name!r}: value merging runs at prefill compression only, not beside a "
                             "decode-time schedule")

    def __str__(self) -> str:
        decode = f" + decode {self.decode['policy']}" if self.decode else ""
        decode += f" in {self.format} pages" if self.format else ""
        inferred = f"; inferred: {self.inferred}" if self.inferred else ""
        methods = f"{self.scorer or 'nothing evicted'} + {self.allocator}{decode}"
        return f"{self.tag}: {methods} ({self.provenance}{inferred})"

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def fingerprint(self) -> str:
        """A hash of the behaviour fields and the code they run (``recipes.fingerprint``): it moves with any
        change of behaviour, so a test can insist that the version moves too."""
        from .fingerprint import fingerprint  # that module reads RECIPES, defined below

        return fingerprint(self)

    def merger(self) -> ValueMerging | None:
        """What folds evicted values into kept entries at a compression (None: nothing is merged)."""
        return None if self.merge is None else ValueMerging(**self.merge)

    def build(self):
        """(scorer, allocator) instances; bad parameters raise here, before the model is touched."""
        try:
            scorer = SCORERS[self.scorer](**self.scorer_args) if self.scorer else None
            return scorer, ALLOCATORS[self.allocator](**self.allocator_args)
        except TypeError as e:  # an unknown or missing parameter name
            raise ValueError(f"recipe {self.name!r}: {e}") from e
