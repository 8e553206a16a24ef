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
from ..model import CompressedModel
from ..recipes import Recipe


def calibration_runner(model, window: int = 0):
    """A full-budget ``CompressedModel`` over ``model``'s programs (nothing re-captured) whose cache observes the
    last ``window`` prefill queries: what calibrated methods (RippleKV, SGD-KV, CateKV) measure a model with."""
    recipe = Recipe("calibration", "snapkv", scorer_args={"window": window}) if window else Recipe("full", None)
    return CompressedModel(model.programs, model.spec, recipe, Budget.parse(1.0), device=model.device,
                           source=model.source)


def cached_calibration(kind: str, model, token_ids: Tensor, params: dict, compute):
    """``compute()`` (a JSON-able list) once per (model weights, ``token_ids``, ``params``), then read back from
    ``$KVCOMPILE_CALIBRATION`` or ``~/.cache/kvcompile/calibration``: a model is measured once, not per run."""
    if model.programs.captured is None:
        raise ValueError("calibration needs a CompressedModel built by kvcompile.apply, not one loaded from an artifact")
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
