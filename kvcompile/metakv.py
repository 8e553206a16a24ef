"""MetaKV (docs/methods.md#metakv): per prompt, pick a configuration (recipe x budget) under the user's latency and
memory limits, by small predictors of each configuration's latency, peak KV memory and probability of a correct answer,
fitted on stored sweep results (``eval.sweep`` per-sample rows, ``eval.store``).

The predictors are linear (latency, memory) and logistic (correctness) in a handful of prompt features, one set
per configuration, stored as JSON (never pickle). Inferred: the paper fits LightGBM on 8,192 profiled prompts; the
features here (``prompt_features``) and the model family are ours, and latency is what the sweep times (compress
and answer after a shared prefill).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

FEATURES = ("bias", "kilotokens", "digits", "distinct")


def prompt_features(text: str, n_tokens: int, token_ids: list[int]) -> list[float]:
    """What MetaKV reads of a prompt before prefill: a bias, its length in thousands of tokens, the share of digit
    characters (x10) and the share of distinct token ids."""
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    return [1.0, n_tokens / 1000, 10 * digits, len(set(token_ids)) / max(len(token_ids), 1)]


def _linear(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> list[float]:
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(x.T @ x + ridge * eye, x.T @ y).tolist()


def _logistic(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-2, steps: int = 50) -> list[float]:
    """Newton's method on the L2-regularised log-loss (a few features: exact and fast)."""
    w = torch.zeros(x.shape[1], dtype=x.dtype)
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    for _ in range(steps):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - y) + ridge * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * eye
        w = w - torch.linalg.solve(hess, grad)
    return w.tolist()


def configuration(config: str) -> tuple[str, float]:
    """``"snapkv/0.25"`` -> ("snapkv", 0.25): a recipe name and a budget fraction, what ``kvcompile.apply`` takes."""
    recipe, _, budget = config.rpartition("/")
    return recipe, float(budget)


@dataclass
class MetaKV:
    """Predictors per configuration ``"recipe/budget"`` (``configuration`` reads one back):
    ``weights[config] = {"latency_ms": [...], "memory": [...], "correct": [...]}`` over ``FEATURES``.
    Build with ``fit``; ``save``/``load`` as JSON."""

    weights: dict = field(default_factory=dict)

    @classmethod
    def fit(cls, rows: list[dict]) -> MetaKV:
        """Rows of ``{"config", "features", "latency_ms", "memory", "correct"}`` (one per prompt and configuration)."""
        by: dict[str, list[dict]] = {}
        for r in rows:
            by.setdefault(r["config"], []).append(r)
        weights = {}
        for config, rs in sorted(by.items()):
            x = torch.tensor([r["features"] for r in rs], dtype=torch.float64)
            col = lambda k: torch.tensor([float(r[k]) for r in rs], dtype=torch.float64)  # noqa: E731
            weights[config] = {"latency_ms": _linear(x, col("latency_ms")), "memory": _linear(x, col("memory")),
                               "correct": _logistic(x, col("correct"))}
        return cls(weights)

    def predict(self, features: list[float]) -> dict[str, dict[str, float]]:
        """{config: {"latency_ms", "memory", "p_correct"}} for one prompt's features."""
        x = torch.tensor(features, dtype=torch.float64)
        out = {}
        for config, w in self.weights.items():
            dot = {k: float(x @ torch.tensor(v, dtype=torch.float64)) for k, v in w.items()}
            out[config] = {"latency_ms": dot["latency_ms"], "memory": dot["memory"],
                           "p_correct": 1 / (1 + math.exp(-dot["correct"]))}
        return out

    def choose(self, features: list[float], max_latency_ms: float, max_memory: float) -> str:
        """The configuration for one prompt (MetaKV's rule): among those predicted within both limits, the
        uncompressed one if it is there, else per recipe its largest feasible budget, the most likely correct of
        those; none feasible: the one least over, by latency / max_latency_ms + memory / max_memory."""
        if not (max_latency_ms > 0 and max_memory > 0):
            raise ValueError(f"max_latency_ms and max_memory must be positive, got {max_latency_ms}, {max_memory}")
        pred = self.predict(features)
        feasible = [c for c, p in pred.items() if p["latency_ms"] <= max_latency_ms and p["memory"] <= max_memory]
        if not feasible:
            return min(pred, key=lambda c: pred[c]["latency_ms"] / max_latency_ms + pred[c]["memory"] / max_memory)
        if any(c.startswith("full/") for c in feasible):
            return next(c for c in feasible if c.startswith("full/"))
        weakest: dict[str, str] = {}
        for c in feasible:
            recipe, budget = configuration(c)
            if recipe not in weakest or budget > configuration(weakest[recipe])[1]:
                weakest[recipe] = c
        return max(weakest.values(), key=lambda c: pred[c]["p_correct"])

    def apply(self, model, prompt_features: list[float], max_latency_ms: float, max_memory: float):
        """``kvcompile.apply(model, ...)`` with the configuration ``choose`` picks for this prompt."""
        import kvcompile

        recipe, budget = configuration(self.choose(prompt_features, max_latency_ms, max_memory))
        return kvcompile.apply(model, recipe=recipe, budget=budget)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"features": FEATURES, "weights": self.weights}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> MetaKV:
        data = json.loads(Path(path).read_text())
        if tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"{path}: predictors over features {data.get('features')}, this MetaKV reads {FEATURES}")
        return cls(data["weights"])
