"""``kvcompile train``: learned scorers trained here, on data generated offline, with targets the library computes.

``train("kvzap", model, tokenizer, name="smollm2-135m")`` collects KVzip targets (``train.kvzap``), fits the
surrogate (``train.loop``), measures it against its own random initialisation on held-out contexts, and writes
``kvzap-<name>.safetensors`` + its JSON card where the ``kvzap`` recipe finds them (``methods.learned``);
``"kvpop"`` does the same with KVpop's keep/drop labels from future attention mass (``train.kvpop``), and
``"kvpop-delayed"`` with the delayed scorer's features (``methods.kvpop.DELAY`` steps of lookahead), and
``"fastkvzip"`` fits FastKVzip's gate (``methods.fastkvzip``) to the same KVzip targets as ``"kvzap-hidden"``. The
run folder keeps the collected data, the checkpoint a rerun resumes from, and the loss curve.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..methods import learned
from ..methods.fastkvzip import Gate
from ..methods.kvpop import DELAY
from .kvpop import auc, kvpop_examples, weighted_bce
from .kvzap import contexts, fit_ridge, gate, kvzip_examples, mse, spearman, surrogate
from .loop import Schedule, fit, plot_losses


@dataclass(frozen=True)
class Method:
    """What one learned scorer trains on: ``examples(cm, texts, per_context, seed, progress)`` -> {"x": features
    [L, Hkv, N, F], "y": targets [L, Hkv, N], ...}; ``loss(examples)`` -> the minibatch loss; ``metric(predicted,
    y)`` on held-out examples, named ``metric_name`` in the card (higher is better)."""

    examples: Callable
    loss: Callable
    metric: Callable
    metric_name: str
    target: str  # what the progress message says is collected
    regression: bool = False  # real targets under squared error: the linear form can be a ridge fit
    net: Callable = surrogate  # (x, y, hidden, seed, group) -> a fresh network to train


def _hidden_kvzip(cm, texts, per_context, seed, progress) -> dict:
    return dict(zip("xy", kvzip_examples(cm, texts, per_context, seed, progress, inputs="hidden")))


METHODS = {
    "kvzap": Method(lambda cm, t, n, s, p: dict(zip("xy", kvzip_examples(cm, t, n, s, p))),
                    lambda d: mse(d["x"], d["y"]), spearman, "held_out_spearman", "KVzip targets (two prefills each)",
                    regression=True),
    "kvzap-hidden": Method(_hidden_kvzip, lambda d: mse(d["x"], d["y"]), spearman, "held_out_spearman",
                           "KVzip targets and attention inputs (three passes each)", regression=True),
    "fastkvzip": Method(_hidden_kvzip, lambda d: mse(d["x"], d["y"]), spearman, "held_out_spearman",
                        "KVzip targets and attention inputs (three passes each)", net=gate),
    "kvpop": Method(kvpop_examples, weighted_bce, auc, "held_out_auc", "future attention mass (one prefill each)"),
    "kvpop-delayed": Method(partial(kvpop_examples, delay=DELAY), weighted_bce, auc, "held_out_auc",
                            f"future attention mass and {DELAY} steps of lookahead (one prefill each)"),
}


def train(method: str, model, tokenizer, *, name: str, schedule: Schedule = Schedule(), hidden: int = 0,
          ridge: float = 0.0, lengths: tuple[int, ...] = (256, 512, 1024), per_length: int = 4, held_out: int = 4,
          per_context: int = 256, out: str | Path | None = None, run_dir: str | Path | None = None,
          progress: bool = True) -> dict:
    """Train ``method`` (a key of ``METHODS``) for ``model`` (a transformers causal LM or a ``CompressedModel``
    of one) and return the weights' card. ``name`` keys the weights (``<method>-<name>.safetensors`` in ``out``,
    default ``methods.learned.trained_root()``); ``schedule`` fixes steps, batch, learning rate and the seed (data
    draws and initialisation follow it too); ``hidden`` > 0 trains the MLP form; ``ridge`` > 0 fits the linear
    form of a regression method in closed form with that penalty instead (no steps); training uses ``per_length``
    contexts of each of ``lengths`` tokens, ``per_context`` tokens of each, and ``held_out`` contexts of the
    largest length from another seed measure it. Rerun with the same arguments to resume."""
    if method not in METHODS:
        raise ValueError(f"unknown method to train {method!r}; trainable: {', '.join(METHODS)}")
    if ridge and (hidden or not METHODS[method].regression):
        raise ValueError(f"ridge fits the linear form of a regression method (kvzap, kvzap-hidden); got {method!r} "
                         f"with hidden={hidden}")
    import kvcompile

    started = time.perf_counter()
    out = Path(out) if out is not None else learned.trained_root()
    run_dir = Path(run_dir) if run_dir is not None else out / "runs" / f"{method}-{name}-seed{schedule.seed}"
    cm = model if isinstance(model, kvcompile.CompressedModel) else kvcompile.apply(model, budget=1.0, recipe="full")
    spec = METHODS[method]
    data = _data(spec, cm, tokenizer, run_dir, lengths, per_length, held_out, per_context, schedule.seed, progress)
    train_set = {k: v for k, v in data.items() if not k.startswith("held_")}
    x, y, hx, hy = (data[k] for k in ("x", "y", "held_x", "held_y"))
    group = cm.spec.num_q_heads // cm.spec.num_kv_heads
    initial, net = (spec.net(x, y, hidden, schedule.seed, group) for _ in range(2))
    if ridge:
        fit_ridge(net, x, y, ridge)
        with torch.no_grad():
            losses = [float(spec.loss(train_set)(m, torch.arange(x.shape[2]))) for m in (initial, net)]
    else:
        losses = fit(net, spec.loss(train_set), x.shape[2], schedule, run_dir, progress)
        plot_losses(losses, run_dir / "loss.png", f"{method} on {name}")
    with torch.no_grad():
        scores = {"trained": spec.metric(net(hx), hy), "random_init": spec.metric(initial(hx), hy)}
        held_loss = float(spec.loss({k[5:]: v for k, v in data.items() if k.startswith("held_")})(
            net, torch.arange(hx.shape[2])))
    card = {
        "method": method, "model": name, "form": _form(net, hidden, ridge),
        "library_version": kvcompile.__version__, "schedule": asdict(schedule),
        "data": {"tasks_and_prose": "train.kvzap.contexts", "targets": spec.target, "lengths": list(lengths),
                 "per_length": per_length,
                 "per_context": per_context, "examples": x.shape[2], "held_out_contexts": held_out,
                 "held_out_examples": hx.shape[2]},
        "tokens_seen": x.shape[2] if ridge else schedule.steps * min(schedule.batch, x.shape[2]),
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "held_out_loss": held_loss, spec.metric_name: scores,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return learned.save(out / f"{method}-{name}.safetensors", net.state_dict(), card)


def _form(net, hidden: int, ridge: float) -> str:
    if isinstance(net, Gate):
        return f"gate-rank{net.wk.shape[-1]}-sinks{net.sinks.shape[2]}"
    return f"mlp{hidden}" if hidden else f"ridge{ridge:g}" if ridge else "linear"


def _data(spec: Method, cm, tokenizer, run_dir: Path, lengths, per_length, held_out, per_context, seed,
          progress) -> dict:
    """The training and held-out (``held_``) examples, collected once per run folder (collection dominates a run's
    time)."""
    path, params = run_dir / "data.safetensors", [list(lengths), per_length, held_out, per_context, seed]
    if path.is_file():
        stored = json.loads(path.with_suffix(".json").read_text())
        if stored != params:
            raise ValueError(f"{run_dir} holds data collected with other parameters ({stored}, asked {params}): "
                             "use another run folder")
        return load_file(str(path))
    data = spec.examples(cm, contexts(tokenizer, lengths, per_length, seed), per_context, seed, progress)
    held = spec.examples(cm, contexts(tokenizer, (max(lengths),), held_out, seed + 1000), per_context, seed + 1,
                         progress)
    data |= {f"held_{k}": v for k, v in held.items()}
    run_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in data.items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(params))
    return data
