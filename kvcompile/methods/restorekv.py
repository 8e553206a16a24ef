"""RestoreKV (kvpress ``RestoreKVPress``, arXiv 2608.01247): before KVzip evicts, a few learned
restore tokens read the whole cache in one LoRA-adapted pass, and their entries stay, so what the eviction loses
can be carried by entries written while it was still there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor

from . import learned
from .base import Restore, register_scorer
from .kvzip import KVzip

TRAIN_HINT = "train them with `kvcompile train restorekv --model {name}` (about 20 minutes on 2 CPU cores)"


@register_scorer("restorekv")
@dataclass
class RestoreKV(KVzip):
    """KVzip's scores, plus ``Restore``: the runtime writes one entry per restore embedding into every (layer, KV
    head) at the positions after the context, from a pass of the source model with the adapter on, before the
    compression; the compression keeps them first (above KVzip's sinks) and charges them to the budget, so KVzip's
    global rule spends only what they leave. The adapter is off for every other token. ``weights`` names the
    trained file (``methods.learned``: ``restorekv-<weights>.safetensors``: ``embeddings`` [n, hidden] and the
    adapter's ``adapter.*`` tensors); ``sha256`` pins it.

    Inferred: the restore pass runs before KVzip's reconstruction (kvpress: after scoring), so the
    reconstruction's queries also see the restore entries; the adapter covers q, k, v, o (the paper's also the MLP),
    rank 8."""

    method: ClassVar[str] = "restorekv"
    weights: str = "smollm2-135m"
    sha256: str = ""
    embeddings: Tensor = field(init=False, repr=False, compare=False)
    adapter: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        tensors, self.card = learned.load(self.method, self.weights, self.sha256,
                                          TRAIN_HINT.format(name=self.weights))
        if "embeddings" not in tensors or not any(k.startswith("adapter.") for k in tensors):
            raise ValueError(f"{self.weights!r} holds no restorekv weights (need 'embeddings' and 'adapter.*' tensors)")
        self.embeddings = tensors["embeddings"]
        self.adapter = {k[len("adapter."):]: v for k, v in tensors.items() if k.startswith("adapter.")}

    def sources(self):
        return (*super().sources(), Restore(self.embeddings.shape[0]))

    def restore_inputs(self) -> tuple[Tensor, dict]:
        """(the restore embeddings [n, hidden], the adapter's tensors) the runtime's restore pass reads."""
        return self.embeddings, self.adapter

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        """Refuse, before anything runs, weights trained for a model of another width or depth."""
        layers = sum(k.startswith("a.") and k.endswith("q_proj") for k in self.adapter)
        if (hidden_size and self.embeddings.shape[1] != hidden_size) or layers != num_layers:
            raise ValueError(f"restorekv weights {self.weights!r} were trained for {layers} layers, hidden size "
                             f"{self.embeddings.shape[1]} (card: {self.card.get('model', '?')}); this model has "
                             f"{num_layers}, {hidden_size or '?'}: " + TRAIN_HINT.format(name="<model>"))
