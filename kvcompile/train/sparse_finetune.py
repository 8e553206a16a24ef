"""Fine-tuning under a compression policy (KeysAndValues, docs/methods_learned.md#sparse-finetune-h2o; issue 17's
``sparse-finetune``): a LoRA adapter (``kvcompile.adapters``) learns to read the cache a recipe leaves, by
self-distillation from the frozen full-cache model.

Each offline context (``train.kvzap.contexts``) is split into a prompt and the ``continuation`` tokens that follow
it. The recipe compresses the prompt at the budget (the library's own compression, through ``kvcompile.apply`` on
the frozen model: the kept positions come from ``CompressedModel.held_positions``); the adapted model then reads
prompt + continuation in one dense pass where the continuation sees only what was kept
(``eval.analysis.masked``, equal to the paged path forward), and the loss is the KL divergence of its next-token
distribution over the continuation from the full-cache model's. Held-out contexts measure the result through the
served path: the recipe applied to the adapted (merged) model, against the frozen model at budget 1.0. The kept
positions are those of the frozen model (inferred: KeysAndValues trains the model while it evicts; here the
selection is not recomputed during training, and at serving time the adapted model selects for itself).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.nn import functional as F
from tqdm import tqdm

from ..adapters import Adapter
from ..eval.analysis.masked import kept, masking
from .kvzap import contexts
from .loop import Schedule
from .lora import train_lora


def examples(model, tokenizer, recipe: str, budget: float, lengths, per_length: int, continuation: int, seed: int,
             progress: bool = True) -> list[dict]:
    """One dict per offline context: ``ids`` [1, n + m], ``keep`` [L, Hkv, n] (what ``recipe`` keeps of the
    prompt at ``budget``), ``teacher`` [m, V] the full-cache model's log-probabilities over the continuation."""
    import kvcompile

    cm = kvcompile.apply(model, budget=budget, recipe=recipe)
    out = []
    for ids in tqdm(contexts(tokenizer, lengths, per_length, seed), desc="contexts", unit="context",
                    disable=not progress, file=sys.stderr):
        ids = torch.tensor([ids])
        n = ids.shape[1] - continuation
        cm.reset()
        cm.prefill(ids[:, :n], logits="last")
        with torch.no_grad():
            teacher = model(ids).logits[0, n:].float().log_softmax(-1)
        out.append({"ids": ids, "keep": kept(cm.held_positions(), n), "teacher": teacher})
    return out


def kl(model, adapter: Adapter, example: dict) -> Tensor:
    """Mean KL(full-cache model || adapted model reading the kept prompt) over the continuation."""
    n = example["keep"].shape[-1]
    with adapter.installed(model), masking(model):
        logits = model(example["ids"], kvc_keep=example["keep"]).logits[0, n:].float()
    return F.kl_div(logits.log_softmax(-1), example["teacher"], log_target=True, reduction="batchmean")


def loss(model, data: list[dict]):
    """The minibatch loss for ``train.loop.fit``: the mean KL of the chosen contexts."""
    def value(adapter, indices):
        return sum(kl(model, adapter, data[int(i)]) for i in indices) / len(indices)
    return value


@torch.no_grad()
def served_kl(model, adapter: Adapter | None, data: list[dict], recipe: str, budget: float) -> float:
    """Mean KL of the served path (``recipe`` at ``budget`` applied to the model, adapted and merged when
    ``adapter`` is given: it selects with its own scores) from the frozen full-cache model, over ``data``."""
    import kvcompile

    cm = kvcompile.apply(adapter.merged(model) if adapter is not None else model, budget=budget, recipe=recipe)
    total = 0.0
    for example in data:
        n = example["keep"].shape[-1]
        cm.reset()
        cm.prefill(example["ids"][:, :n], logits="last")
        logits = cm.prefill(example["ids"][:, n:], compress=False)[0].float()
        total += float(F.kl_div(logits.log_softmax(-1), example["teacher"], log_target=True, reduction="batchmean"))
    return total / len(data)


def finetune(model, tokenizer, *, name: str, recipe: str = "h2o", budget: float = 0.25,
             schedule: Schedule = Schedule(steps=100, batch=2, lr=2e-3), rank: int = 8,
             lengths: tuple[int, ...] = (512,), per_length: int = 16, held_out: int = 4, continuation: int = 64,
             out=None, run_dir=None, progress: bool = True) -> dict:
    """Train the adapter of ``recipe`` at ``budget`` for ``model`` (a transformers causal LM) and write it as
    ``sparse-finetune-<recipe>-<name>.safetensors`` + card in ``out`` (default ``methods.learned.trained_root()``);
    the card's ``held_out_kl`` is the served path's KL on ``held_out`` contexts from another seed, trained and
    untrained (the model itself: B starts at zero). Rerun with the same arguments to resume."""
    import kvcompile

    data = examples(model, tokenizer, recipe, budget, lengths, per_length, continuation, schedule.seed, progress)
    held = examples(model, tokenizer, recipe, budget, (max(lengths),), held_out, continuation, schedule.seed + 1000,
                    progress)
    card = {"recipe": kvcompile.get_recipe(recipe).tag, "budget": budget,
            "data": {"tasks_and_prose": "train.kvzap.contexts", "lengths": list(lengths), "per_length": per_length,
                     "continuation": continuation, "held_out_contexts": held_out},
            "tokens_seen": schedule.steps * min(schedule.batch, len(data)) * continuation}

    def measure(adapter):
        return {"held_out_kl": {"trained": served_kl(model, adapter, held, recipe, budget),
                                "random_init": served_kl(model, None, held, recipe, budget)}}

    return train_lora(model, f"sparse-finetune-{recipe}", name, loss(model, data), len(data), measure, card,
                      schedule=schedule, rank=rank, out=out, run_dir=run_dir, progress=progress,
                      ylabel="KL to the full cache")
