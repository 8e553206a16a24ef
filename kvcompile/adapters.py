"""LoRA adapters on a transformers model's attention projections: trained through forward hooks (the model's own
weights untouched and frozen), shipped as safetensors (``methods.learned``), and served merged into a copy of the
model (W + scale * B @ A), so the captured programs run an ordinary model and nothing in the runtime knows of them.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor, nn

from .methods import learned

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class Adapter(nn.Module):
    """Rank-``rank`` updates of every ``nn.Linear`` of ``model`` whose name ends in one of ``targets``; B starts at
    zero, so an untrained adapter is the model itself. Parameters are keyed by module path ('.' -> '/')."""

    def __init__(self, model: nn.Module, rank: int = 8, alpha: float = 16.0, targets=TARGETS, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        g = torch.Generator().manual_seed(seed)
        self.scale, self.targets = alpha / rank, tuple(targets)
        self.a, self.b = nn.ParameterDict(), nn.ParameterDict()
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                key = name.replace(".", "/")
                self.a[key] = nn.Parameter(torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5)
                self.b[key] = nn.Parameter(torch.zeros(module.out_features, rank))
        if not self.a:
            raise ValueError(f"the model has no nn.Linear named {'/'.join(targets)} to adapt")
        self.register_buffer("alpha_over_rank", torch.tensor(self.scale))

    @classmethod
    def from_tensors(cls, model: nn.Module, tensors: dict[str, Tensor]) -> Adapter:
        """The adapter whose ``state_dict`` was saved as ``tensors``, for ``model`` (refused if they do not fit)."""
        rank = next(v for k, v in tensors.items() if k.startswith("a.")).shape[0]
        targets = {k.split(".", 1)[1].rsplit("/", 1)[-1] for k in tensors if k.startswith("a.")}
        net = cls(model, rank, float(tensors["alpha_over_rank"]) * rank, tuple(sorted(targets)))
        try:
            net.load_state_dict(tensors)
        except RuntimeError as e:
            raise ValueError(f"these adapter weights do not fit this model: {e}") from None
        return net.requires_grad_(False)

    def delta(self, key: str) -> Tensor:
        return self.scale * self.b[key] @ self.a[key]

    @contextlib.contextmanager
    def installed(self, model: nn.Module, tokens: Tensor | None = None):
        """Within the block, ``model``'s adapted projections add x A^T B^T * scale (gradients reach A and B), at
        every token, or only where ``tokens`` [T] is True (a restore pass's restore tokens, in a pass over more)."""
        modules = dict(model.named_modules())
        hooks = [modules[key.replace("/", ".")].register_forward_hook(self._hook(key, tokens)) for key in self.a]
        try:
            yield model
        finally:
            for h in hooks:
                h.remove()

    def _hook(self, key: str, tokens: Tensor | None):
        def add(module, args, out):
            delta = args[0].to(self.a[key].dtype) @ self.a[key].T @ self.b[key].T * self.scale
            return out + (delta if tokens is None else delta * tokens[:, None]).to(out.dtype)
        return add

    @torch.no_grad()
    def merged(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` with every update folded into its weights (the model itself is not modified)."""
        out = copy.deepcopy(model)
        modules = dict(out.named_modules())
        for key in self.a:
            weight = modules[key.replace("/", ".")].weight
            weight.add_(self.delta(key).to(weight.dtype))
        return out


def adapted(model: nn.Module, spec: dict) -> nn.Module:
    """A copy of ``model`` with the adapter a recipe names (``Recipe.adapter``: its method, weights and pinned
    SHA-256, looked up as ``methods.learned`` looks up weights) merged in."""
    method, weights = spec["method"], spec["weights"]
    hint = f"train it (docs/guide.md, \"Adapters\"), e.g. `kvcompile train abstain --model {weights}`"
    tensors, _ = learned.load(method, weights, spec.get("sha256", ""), hint)
    return Adapter.from_tensors(model, tensors).merged(model)
