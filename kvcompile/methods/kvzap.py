"""KVzap (kvpress ``KVzapPress``, arXiv 2601.07891): a small per-layer model predicts, from each
token alone, the log of the KVzip score it would get, so a cache is ranked without KVzip's second prefill.

Two inputs (``KVzap.inputs``). ``"hidden"``, as kvpress: the attention input h_j (the normed hidden state before
k_proj), the ``HiddenStates`` source; kvpress reads it from the forward it is running, here it costs one dense
forward of the source model over the context (``kvcompile.attention_inputs``), so the context is read in one
prefill. ``"cache"`` (inferred, the first form, still what ``dms``/``dms-decode`` read: the decode steps supply no
hidden states): what the cache holds for that token and head: its value, the norms of its key's rotary pairs (the
rotation by position leaves them unchanged: HF's rotate-half layout pairs channel i with i + D/2), and the log norms
of key and value. One surrogate per (layer, KV head), so heads that hold different tokens (after an earlier
compression) are scored alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import learned
from .base import HiddenStates, Observation, Scorer, protect, register_scorer

TRAIN_HINT = "train them with `kvcompile train {method} --model {name}` (minutes on 2 CPU cores; see docs/guide.md)"


def token_features(keys: Tensor, values: Tensor) -> Tensor:
    """[..., S, D] keys (post-RoPE) and values -> [..., S, 3D/2 + 2] what the surrogate reads of each token."""
    k, v = keys.float(), values.float()
    half = k.shape[-1] // 2
    pairs = (k[..., :half].square() + k[..., half : 2 * half].square()).sqrt()
    norms = torch.stack([k.norm(dim=-1), v.norm(dim=-1)], -1).clamp_min(1e-6).log()
    return torch.cat([v, pairs, norms], -1)


class Surrogate(nn.Module):
    """Normalised features -> predicted log KVzip score, one model per (layer, KV head): linear (``hidden=0``,
    kvpress's ridge form) or one GELU layer of ``hidden`` units (kvpress's MLP form). Parameters carry a leading
    [L, Hkv]; ``forward`` reads all layers at once (training) or one (``layer``: scoring)."""

    def __init__(self, layers: int, heads: int, features: int, hidden: int = 0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shape = (layers, heads)
        self.register_buffer("mean", torch.zeros(*shape, features))
        self.register_buffer("std", torch.ones(*shape, features))
        if hidden:
            self.w1 = nn.Parameter(torch.randn(*shape, features, hidden, generator=g) / features**0.5)
            self.b1 = nn.Parameter(torch.zeros(*shape, hidden))
            self.w = nn.Parameter(torch.randn(*shape, hidden, generator=g) / hidden**0.5)
        else:
            self.w = nn.Parameter(torch.randn(*shape, features, generator=g) / features**0.5)
        self.b = nn.Parameter(torch.zeros(*shape))

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.mean.shape)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Surrogate:
        L, H, F = tensors["mean"].shape
        net = cls(L, H, F, tensors["w1"].shape[-1] if "w1" in tensors else 0)
        net.load_state_dict(tensors)
        return net.requires_grad_(False)

    def forward(self, x: Tensor, layer: int | None = None) -> Tensor:
        """x [..., Hkv, N, F] (with ``layer``) or [L, Hkv, N, F] -> [..., Hkv, N]."""
        p = {k: (v if layer is None else v[layer]) for k, v in self.state_dict(keep_vars=True).items()}
        x = (x - p["mean"].unsqueeze(-2)) / p["std"].unsqueeze(-2)
        if "w1" in p:
            x = nn.functional.gelu(x @ p["w1"] + p["b1"].unsqueeze(-2))
        return (x * p["w"].unsqueeze(-2)).sum(-1) + p["b"].unsqueeze(-1)


def load_surrogate(method: str, weights: str, sha256: str, net_class: type = Surrogate) -> tuple[nn.Module, dict]:
    """(the ``net_class`` network, its card) of ``<method>-<weights>`` (``methods.learned``), refused with the train
    hint."""
    tensors, card = learned.load(method, weights, sha256, TRAIN_HINT.format(method=method, name=weights))
    return net_class.from_tensors(tensors), card


@register_scorer("kvzap")
@dataclass
class KVzap(Scorer):
    """Predicted log KVzip scores from trained weights (``methods.learned``: ``weights`` names them, a model key
    such as ``"smollm2-135m"`` or a ``.safetensors`` path; ``sha256`` pins the file). No weights: refused when the
    recipe is built, never run untrained. The first ``n_sink`` tokens are kept, as KVzip keeps them. Reads no
    queries: each token is scored from its own ``inputs`` alone ("cache": its entries; "hidden": its attention
    input, weights ``<method>-hidden-<weights>``)."""

    method: ClassVar[str] = "kvzap"  # the weights' file prefix and the train command's method
    net_class: ClassVar[type] = Surrogate  # what the weights are the parameters of
    weights: str = "smollm2-135m"
    sha256: str = ""
    n_sink: int = 4
    inputs: str = "cache"
    net: nn.Module = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.n_sink < 0:
            raise ValueError(f"{self.method}: n_sink must be >= 0, got {self.n_sink}")
        if self.inputs not in ("cache", "hidden"):
            raise ValueError(f"{self.method}: inputs must be 'cache' or 'hidden', got {self.inputs!r}")
        self.net, self.card = load_surrogate(self.trained, self.weights, self.sha256, self.net_class)

    @property
    def trained(self) -> str:
        """What ``kvcompile train`` calls the weights of this input form (their file prefix)."""
        return self.method if self.inputs == "cache" else f"{self.method}-hidden"

    @property
    def observation_window(self) -> int:
        return 0

    def sources(self):
        return (HiddenStates(),) if self.inputs == "hidden" else ()

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        """Refuse, before anything runs, weights trained for another shape of model (a model that does not declare
        its hidden size is checked when the first hidden states arrive)."""
        features = 3 * (head_dim // 2) + 2 if self.inputs == "cache" else hidden_size or self.net.shape[2]
        if self.net.shape != (num_layers, num_kv_heads, features):
            raise ValueError(f"{self.method} weights {self.weights!r} were trained for {self.net.shape[0]} layers x "
                             f"{self.net.shape[1]} KV heads, {self.net.shape[2]} features (card: "
                             f"{self.card.get('model', '?')}); this model has {num_layers} x {num_kv_heads}, "
                             f"{features} {self.inputs} features: "
                             + TRAIN_HINT.format(method=self.trained, name="<model>"))

    def score(self, obs: Observation) -> Tensor:
        if self.net.b.device != obs.keys.device:
            self.net.to(obs.keys.device)
        x = token_features(obs.keys, obs.values) if self.inputs == "cache" else obs.hidden
        return protect(self.net(x, obs.layer), obs.positions < self.n_sink)
