"""One small, reproducible training loop for learned scorers: seeded minibatches, AdamW with a cosine learning
rate, gradient clipping, a progress bar, checkpoints that a rerun resumes from, and a loss curve.

Reproducible: the minibatch of step t is drawn from a generator seeded by (seed, t), and the learning rate is a
function of t, so a run resumed from a checkpoint takes the same steps as one that never stopped (bitwise on CPU).
Checkpoints hold the parameters, the optimizer's moments and the losses so far (safetensors + JSON, no pickle).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm


@dataclass(frozen=True)
class Schedule:
    steps: int = 300
    batch: int = 512
    lr: float = 5e-3
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100

    def __post_init__(self):
        if self.steps < 1 or self.batch < 1 or self.checkpoint_every < 1:
            raise ValueError(f"steps, batch and checkpoint_every must be >= 1, got {self}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def lr_at(self, step: int) -> float:
        return self.lr * 0.5 * (1 + math.cos(math.pi * step / self.steps))


def fit(net: nn.Module, loss: Callable[[nn.Module, Tensor], Tensor], examples: int, schedule: Schedule,
        run_dir: Path | None = None, progress: bool = True) -> list[float]:
    """Train ``net`` for ``schedule.steps`` steps of ``loss(net, indices)`` over minibatches of ``examples`` indices;
    returns the loss of every step. With ``run_dir``, a checkpoint is written every ``checkpoint_every`` steps and
    at the end, and a checkpoint found there is resumed (a finished run returns at once)."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=schedule.weight_decay)
    losses: list[float] = []
    if run_dir is not None and (run_dir / "checkpoint.json").is_file():
        losses = _restore(net, opt, params, run_dir, schedule)
    bar = tqdm(range(len(losses), schedule.steps), initial=len(losses), total=schedule.steps, desc="train",
               disable=not progress, file=sys.stderr)
    for step in bar:
        g = torch.Generator().manual_seed(schedule.seed * 1_000_003 + step)
        indices = torch.randint(examples, (min(schedule.batch, examples),), generator=g)
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        opt.zero_grad(set_to_none=True)
        value = loss(net, indices)
        value.backward()
        nn.utils.clip_grad_norm_(params, schedule.clip)
        opt.step()
        losses.append(value.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if run_dir is not None and ((step + 1) % schedule.checkpoint_every == 0 or step + 1 == schedule.steps):
            _checkpoint(net, opt, params, run_dir, schedule, losses)
    return losses


def _checkpoint(net, opt, params, run_dir: Path, schedule: Schedule, losses: list[float]) -> None:
    tensors = {f"net.{k}": v for k, v in net.state_dict().items()}
    for i, p in enumerate(params):
        tensors.update({f"opt.{i}.{k}": torch.as_tensor(v) for k, v in opt.state[p].items()})
    run_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(run_dir / "checkpoint.safetensors"))
    state = {"schedule": asdict(schedule), "losses": losses}
    (run_dir / "checkpoint.json").write_text(json.dumps(state))


def _restore(net, opt, params, run_dir: Path, schedule: Schedule) -> list[float]:
    state = json.loads((run_dir / "checkpoint.json").read_text())
    if state["schedule"] != asdict(schedule):
        raise ValueError(f"the checkpoint in {run_dir} was written by another schedule ({state['schedule']}); "
                         f"resume with the same one or start in a fresh folder")
    tensors = load_file(str(run_dir / "checkpoint.safetensors"))
    net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
    for i, p in enumerate(params):
        prefix = f"opt.{i}."
        opt.state[p] = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return list(state["losses"])


def plot_losses(losses: list[float], path: Path, title: str, ylabel: str = "loss (MSE)") -> Path | None:
    """The loss curve as a PNG (None, with a note, when matplotlib, an optional dependency, is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install kvcompile[bench])", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel=ylabel, title=title, yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
