"""Per-model calibration for methods that measure a model once (RippleKV, SGD-KV, CateKV, Q-Filters).

Calibration runs the model, so it lives above the runtime: each module here measures a ``CompressedModel`` and
returns plain numbers that a method's dataclass takes as a parameter (``methods`` never runs a model). This module
has the runner over a model's programs and a disk cache keyed by the model's weights, the input and the parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor

from ..budget import Budget
from ..methods.rope import rotate
from ..model import CompressedModel
from ..observation import observe
from ..recipes import Recipe


def calibration_runner(model, window: int = 0):
    """A full-budget ``CompressedModel`` over ``model``'s programs (nothing re-captured) whose cache observes the
    last ``window`` prefill queries: what calibrated methods (RippleKV, SGD-KV, CateKV) measure a model with."""
    recipe = Recipe("calibration", "snapkv", scorer_args={"window": window}) if window else Recipe("full", None)
    return CompressedModel(model.programs, model.spec, recipe, Budget.parse(1.0), device=model.device,
                           source=model.source)


@torch.no_grad()
def prefill_heads(model, ids: Tensor) -> list[tuple[Tensor, ...]]:
    """Per layer: (queries [Hkv, G*W, D], query positions [Hkv, G*W], keys, values [Hkv, S, D], positions [Hkv, S]),
    post-RoPE, of one prompt ``ids`` [1, T] read uncompressed (every query observed; -1: no entry)."""
    runner = calibration_runner(model, window=ids.shape[1])
    runner.prefill(ids.to(runner.device), compress=False, logits="last")
    out = []
    for layer in runner.programs.layers:
        obs = observe(runner.cache, layer)
        Hkv, (_, Hq, W, D) = obs.keys.shape[1], obs.queries.shape
        queries = obs.queries[0].reshape(Hkv, Hq // Hkv * W, D).float()
        q_pos = obs.query_positions[0].repeat(Hq // Hkv)[None].expand(Hkv, -1)
        seen = q_pos >= 0
        out.append((queries[:, seen[0]], q_pos[:, seen[0]], obs.keys[0].float(), obs.values[0].float(),
                    obs.positions[0].masked_fill(~obs.valid[0], -1)))
    return out


def unrotated(x: Tensor, positions: Tensor, inv_freq) -> Tensor:
    """Pre-RoPE rows of post-RoPE ``x`` [..., D] at ``positions`` (as is for a model without rotary buffers)."""
    return rotate(x, -positions.clamp_min(0), torch.tensor(inv_freq)) if inv_freq else x


def cached_calibration(kind: str, model, token_ids: Tensor, params: dict, compute):
    """``compute()`` (a JSON-able list) once per (model weights, ``token_ids``, ``params``), then read back from
    ``$KVCOMPILE_CALIBRATION`` or ``~/.cache/kvcompile/calibration``: a model is measured once, not per run."""
    if model.programs.captured is None:
        raise ValueError("calibration needs a CompressedModel built by kvcompile.apply, not one loaded from "
                         "an artifact")
    weights = [t.double().sum() for t in model.programs.captured.state_dict().values()]
    key = hashlib.sha256(repr((kind, model.spec, params, token_ids.tolist())).encode())
    key.update(torch.stack(weights).cpu().numpy().tobytes())
    root = Path(os.environ.get("KVCOMPILE_CALIBRATION") or Path.home() / ".cache" / "kvcompile" / "calibration")
    path = root / f"{kind}-{key.hexdigest()[:24]}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result
