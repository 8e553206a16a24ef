"""Where learned scorers' weights live and how they are read: a safetensors file of tensors and a JSON card beside
it (model, data, steps, loss, seed, library version, the file's SHA-256). Nothing is ever unpickled.

A name resolves to ``<method>-<name>.safetensors`` in ``$KVCOMPILE_WEIGHTS`` (default
``~/.cache/kvcompile/weights``: what ``kvcompile train`` writes), then in the package's ``kvcompile/weights`` (what
ships); a name ending in ``.safetensors`` is a path. Given a ``sha256``, only a file with that digest is taken, so a
recipe that pins one always runs the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHIPPED = Path(__file__).resolve().parent.parent / "weights"


def trained_root() -> Path:
    """The folder ``kvcompile train`` writes finished weights to."""
    return Path(os.environ.get("KVCOMPILE_WEIGHTS") or Path.home() / ".cache" / "kvcompile" / "weights")


def candidates(method: str, name: str) -> list[Path]:
    if name.endswith(".safetensors"):
        return [Path(name)]
    return [trained_root() / f"{method}-{name}.safetensors", SHIPPED / f"{method}-{name}.safetensors"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(path: Path, tensors: dict[str, torch.Tensor], card: dict) -> dict:
    """Write ``tensors`` (contiguous CPU copies) and ``card`` + the file's SHA-256 beside it (``.json``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    card = {**card, "sha256": digest(path)}
    path.with_suffix(".json").write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")
    return card


class MissingWeights(FileNotFoundError):
    """No weights ``name`` of ``method`` (with digest ``sha256``, when pinned) where ``candidates`` looked."""

    def __init__(self, message: str, method: str, name: str, sha256: str):
        super().__init__(message)
        self.method, self.name, self.sha256 = method, name, sha256


def load(method: str, name: str, sha256: str = "", train_hint: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, card) of the first candidate file (``candidates``) whose digest is ``sha256`` (any, when empty).
    Raises ``MissingWeights`` (a ``FileNotFoundError``) naming where it looked and how to make the weights: a learned
    scorer never runs untrained."""
    looked = []
    for path in candidates(method, name):
        looked.append(str(path))
        if path.is_file() and (not sha256 or digest(path) == sha256):
            card_path = path.with_suffix(".json")
            card = json.loads(card_path.read_text()) if card_path.is_file() else {}
            return load_file(str(path)), card
    pinned = f" with SHA-256 {sha256[:12]}..." if sha256 else ""
    raise MissingWeights(f"no trained {method} weights {name!r}{pinned} (looked in: {', '.join(looked)}); "
                         f"{train_hint or 'train them first'}", method, name, sha256)
