"""One run that trains a LoRA adapter (``kvcompile.adapters``) for a method that reads a compressed cache
(``train.sparse_finetune``, ``train.abstain``): the adapter fitted by ``train.loop.fit`` (seeded, checkpointed,
resumable), its loss curve, and its weights + card written where a recipe's ``adapter`` finds them
(``<method>-<name>.safetensors``, ``methods.learned``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..adapters import TARGETS, Adapter
from ..methods import learned
from .loop import Schedule, fit, plot_losses


def train_lora(model, method: str, name: str, loss: Callable, examples: int, measure: Callable[[Adapter], dict],
               card: dict, *, schedule: Schedule, rank: int, out=None, run_dir=None, progress: bool = True,
               ylabel: str = "loss", net=None) -> dict:
    """Fit a rank-``rank`` adapter of ``model`` (frozen), or ``net`` (a module holding one: RestoreKV's), to
    ``loss(adapter, indices)`` over ``examples`` examples, then write it with ``card`` + the run's facts +
    ``measure(adapter)`` (held-out numbers) as its card."""
    import kvcompile

    started = time.perf_counter()
    out = Path(out) if out is not None else learned.trained_root()
    run_dir = Path(run_dir) if run_dir is not None else out / "runs" / f"{method}-{name}-seed{schedule.seed}"
    model.requires_grad_(False)
    adapter = net if net is not None else Adapter(model, rank=rank, seed=schedule.seed)
    losses = fit(adapter, loss, examples, schedule, run_dir, progress)
    plot_losses(losses, run_dir / "loss.png", f"{method} on {name}", ylabel=ylabel)
    card = {"method": method, "model": name, "form": f"lora-rank{rank}-{'-'.join(TARGETS)}",
            "library_version": kvcompile.__version__, "schedule": asdict(schedule), **card,
            "initial_loss": losses[0], "final_loss": losses[-1], **measure(adapter)}
    card["seconds"] = round(time.perf_counter() - started, 1)
    return learned.save(out / f"{method}-{name}.safetensors", adapter.state_dict(), card)
