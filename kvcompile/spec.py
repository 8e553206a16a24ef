"""What kvcompile needs to know about a model's attention, read from its config (never from its name)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as the cache and the methods see it: softmax ``scale``, sliding ``window`` (0 = full),
    ``weights``: the layer's weights a method may read by name (``"o_proj"``: W_O [hidden, Hq * D], when found);
    ``rotary``: its RoPE inverse frequencies (``ModelSpec.rotary``; () when unknown)."""

    index: int
    scale: float
    window: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    weights: dict = field(default_factory=dict, compare=False, repr=False)
    rotary: tuple[float, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class ModelSpec:
    """Attention geometry of a causal LM.

    ``windows[l]`` is layer l's sliding window (0 = full attention). ``hf_causal_lm`` marks a transformers model,
    whose SDPA mask is known to be causal + padding (+ sliding window) and can be rebuilt from positions.
    ``dtype``: the weights' dtype at capture. ``rotary[l]``: layer l's RoPE inverse frequencies, read from the
    model's rotary buffers (empty when the model has none the spec can read): key re-rotation needs them.
    ``hidden_size``: the width of the hidden states (0: not declared).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windows: tuple[int, ...]
    max_positions: int | None
    hf_causal_lm: bool
    rotary: tuple[tuple[float, ...], ...] = ()
    hidden_size: int = 0

    def layers(self, scales, weights=None) -> tuple[LayerSpec, ...]:
        """One ``LayerSpec`` per layer, with the softmax scales the graph uses and the weights it found
        (``passes.InsertPagedAttention``)."""
        weights = weights or [{}] * self.num_layers
        return tuple(
            LayerSpec(i, float(s), w, self.num_q_heads, self.num_kv_heads, self.head_dim, found,
                      self.rotary[i] if self.rotary else ())
            for i, (s, w, found) in enumerate(zip(scales, self.windows, weights))
        )

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelSpec:
        """Read the spec from a transformers config, or from attributes a plain module declares.

        A plain module declares ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim`` (and optionally
        ``max_positions``) as attributes or in a ``config`` object.
        """
        cfg = getattr(model, "config", model)
        dtype = next(model.parameters()).dtype
        hf = hasattr(model, "generation_config") or type(cfg).__module__.startswith("transformers")
        if hf:
            cfg = getattr(cfg, "text_config", cfg) if not hasattr(cfg, "num_hidden_layers") else cfg
            if getattr(cfg, "attention_chunk_size", None):
                raise ValueError("chunked local attention (config.attention_chunk_size) is not supported yet")
            n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
            n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
            types = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
            window = getattr(cfg, "sliding_window", None) or 0
            windows = tuple(window if t == "sliding_attention" else 0 for t in types)
            max_pos = getattr(cfg, "max_position_embeddings", None)
        else:
            try:
                n_layers, n_heads, head_dim = cfg.num_layers, cfg.num_heads, cfg.head_dim
            except AttributeError as e:
                raise ValueError(
                    f"{type(model).__name__} is not a transformers model and does not declare its attention geometry: "
                    "give it num_layers, num_heads, num_kv_heads and head_dim attributes (or a config holding them)"
                ) from e
            n_kv = getattr(cfg, "num_kv_heads", n_heads)
            windows = (0,) * n_layers
            max_pos = getattr(cfg, "max_positions", None)
        if n_heads % n_kv:
            raise ValueError(f"{n_heads} query heads is not a multiple of {n_kv} KV heads")
        rotary = _rotary(model, getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers) if hf else ()
        return cls(n_layers, n_heads, n_kv, head_dim, dtype, windows, max_pos, hf, rotary,
                   getattr(cfg, "hidden_size", 0) or 0)


def _rotary(model: nn.Module, layer_types) -> tuple[tuple[float, ...], ...]:
    """Per layer, the ``inv_freq`` buffer of the model's rotary embedding: ``<layer type>_inv_freq`` where the model
    keeps one per layer type (Gemma-3's local and global RoPE), else the one ``inv_freq``; () when not found."""
    found = {name.rsplit(".", 1)[-1]: b for name, b in model.named_buffers() if name.endswith("inv_freq")
             and "original" not in name.rsplit(".", 1)[-1]}
    per_layer = [found.get(f"{t}_inv_freq", found.get("inv_freq")) for t in layer_types]
    if any(f is None for f in per_layer):
        return ()
    return tuple(tuple(float(x) for x in f.tolist()) for f in per_layer)
