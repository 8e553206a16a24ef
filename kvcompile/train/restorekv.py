"""RestoreKV's training (docs/methods_learned.md#restorekv, issue 17's ``restorekv``): restore embeddings and a LoRA
adapter learn, by self-distillation from the frozen full-cache model, to write entries that carry what KVzip evicts.

Each offline context (``train.kvzap.contexts``) is split into a prompt and the ``continuation`` tokens after it.
``restorekv`` with the initial weights compresses the prompt at each training budget (the library's own compression:
the kept positions come from ``CompressedModel.held_positions``). The trained model then reads, in one dense pass
(``eval.analysis.masked``, equal to the paged path forward): the prompt (adapter off), the restore embeddings
(adapter on, reading the whole prompt), and the continuation (adapter off), which sees the kept prompt tokens and
the restore entries; the loss is the KL divergence of its next-token distribution over the continuation from the
full-cache model's. Held-out contexts measure the served path (``restorekv`` with the trained weights against the
frozen model at budget 1.0).

Inferred: the data (the paper: questions the frozen model writes about long documents; here the continuation of
offline contexts, as ``sparse-finetune``); the kept set stays the initial weights' while training (KVzip's scores
shift little with the restore entries); the initial embeddings are those of random tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..adapters import Adapter
from ..eval.analysis.masked import masking
from ..methods import learned
from .loop import Schedule
from .lora import train_lora
from .sparse_finetune import examples, served_kl


class Restorer(nn.Module):
    """What RestoreKV learns: ``embeddings`` [tokens, hidden] (the restore tokens' inputs, initialised as the
    embeddings of random tokens) and ``adapter``, on only while they are read. Its ``state_dict`` is the weights
    file the ``restorekv`` scorer reads."""

    def __init__(self, model: nn.Module, tokens: int = 8, rank: int = 8, seed: int = 0):
        super().__init__()
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        self.adapter = Adapter(model, rank=rank, seed=seed)
        table = model.get_input_embeddings()
        ids = torch.randint(table.num_embeddings, (tokens,), generator=torch.Generator().manual_seed(seed))
        self.embeddings = nn.Parameter(table(ids.to(table.weight.device)).detach().float().cpu().clone())

    def forward(self, model: nn.Module, ids: Tensor, keep: Tensor) -> Tensor:
        """Logits [T - n, V] of the tokens of ``ids`` [1, T] after its first n (``keep`` [L, Hkv, n]: what each
        (layer, KV head) kept of them), read after the restore tokens, as the served cache reads them."""
        n, r = keep.shape[-1], self.embeddings.shape[0]
        embedded = model.get_input_embeddings()(ids)
        inputs = torch.cat([embedded[:, :n], self.embeddings[None].to(embedded.dtype), embedded[:, n:]], 1)
        restoring = torch.zeros(inputs.shape[1], device=inputs.device)
        restoring[n : n + r] = 1.0
        document = torch.cat([keep, keep.new_ones(*keep.shape[:-1], r)], -1)  # the restore rows read it whole
        with self.adapter.installed(model, restoring), masking(model):
            return model(inputs_embeds=inputs, kvc_keep=document).logits[0, n + r :]


def loss(model, data: list[dict]):
    """The minibatch loss for ``train.loop.fit``: mean KL(full-cache model || restored compressed cache)."""
    def value(restorer, indices):
        total = 0.0
        for i in indices:
            example = data[int(i)]
            logits = restorer(model, example["ids"], example["keep"]).float()
            total = total + F.kl_div(logits.log_softmax(-1), example["teacher"], log_target=True,
                                     reduction="batchmean")
        return total / len(indices)
    return value


def recipe_with(weights: str):
    """The ``restorekv`` recipe reading ``weights`` (a ``.safetensors`` path), unpinned."""
    import kvcompile

    base = kvcompile.get_recipe("restorekv")
    return dataclasses.replace(base, scorer_args={**base.scorer_args, "weights": str(weights), "sha256": ""})


def finetune(model, tokenizer, *, name: str, budgets: tuple[float, ...] = (0.05, 0.1, 0.25), tokens: int = 8,
             schedule: Schedule = Schedule(steps=150, batch=2, lr=2e-3), rank: int = 8,
             lengths: tuple[int, ...] = (768,), per_length: int = 12, held_out: int = 4, continuation: int = 64,
             out=None, run_dir=None, progress: bool = True) -> dict:
    """Train RestoreKV's ``tokens`` restore embeddings and rank-``rank`` adapter for ``model`` (a transformers causal
    LM), each context compressed at each of ``budgets`` (one set of weights serves them all), and write them as
    ``restorekv-<name>.safetensors`` + card in ``out`` (default ``methods.learned.trained_root()``). The card's
    ``held_out_kl`` is, per budget, the served path's KL on ``held_out`` contexts from another seed: trained, at the
    initial weights, and plain ``kvzip`` (the heuristic it builds on, every byte on context). Rerun with the same
    arguments to resume."""
    from pathlib import Path

    out = Path(out) if out is not None else learned.trained_root()
    run_dir = Path(run_dir) if run_dir is not None else out / "runs" / f"restorekv-{name}-seed{schedule.seed}"
    model.requires_grad_(False)
    restorer = Restorer(model, tokens, rank, schedule.seed)
    initial = run_dir / "initial.safetensors"
    learned.save(initial, restorer.state_dict(), {"method": "restorekv", "model": name, "initial": True})
    data, held = [], {}
    for budget in budgets:
        data += examples(model, tokenizer, recipe_with(initial), budget, lengths, per_length, continuation,
                         schedule.seed, progress)
        held[budget] = examples(model, tokenizer, recipe_with(initial), budget, (max(lengths),), held_out,
                                continuation, schedule.seed + 1000, progress)
    card = {"recipe": "restorekv", "budgets": list(budgets), "form": f"restore{tokens}-lora-rank{rank}-"
            + "-".join(restorer.adapter.targets),
            "data": {"tasks_and_prose": "train.kvzap.contexts", "lengths": list(lengths), "per_length": per_length,
                     "continuation": continuation, "held_out_contexts": held_out},
            "tokens_seen": schedule.steps * min(schedule.batch, len(data)) * continuation}

    def measure(net):
        trained = run_dir / "trained.safetensors"
        learned.save(trained, net.state_dict(), {"method": "restorekv", "model": name})
        recipes = {"trained": recipe_with(trained), "random_init": recipe_with(initial), "kvzip": "kvzip"}
        return {"held_out_kl": {str(b): {k: served_kl(model, None, held[b], r, b) for k, r in recipes.items()}
                                for b in budgets}}

    return train_lora(model, "restorekv", name, loss(model, data), len(data), measure, card, schedule=schedule,
                      rank=rank, out=out, run_dir=run_dir, progress=progress, ylabel="KL to the full cache",
                      net=restorer)
