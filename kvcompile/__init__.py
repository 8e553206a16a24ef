"""kvcompile: compile-time KV-cache compression that really holds only its budget.

The path of one token: ``apply`` captures the model (``capture.capture``), reads its attention geometry
(``spec.ModelSpec``) and returns a ``CompressedModel`` (``runtime``), which rewrites the captured graph twice
(``passes.rewrite``: a prefill and a decode program whose attention ops live in ``ops``) over one
``cache.PagedKVCache``. ``CompressedModel.generate`` -> ``prefill``/``decode`` -> the program's ops write K/V into
pages and attend (``kernels``) -> ``compress.compress`` scores (``methods``), allocates and compacts to the budget.
``export``/``load`` (``artifact``) ship the two programs as AOTInductor packages.

Example::

    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.25, recipe="snapkv")
    out = cm.generate(**tok("...", return_tensors="pt"), max_new_tokens=32)
    print(cm.cache_stats()["bytes_held"])
"""

from __future__ import annotations

from torch import nn

from .artifact import export, load
from .budget import Budget
from .capture import capture
from .recipes import Recipe, get_recipe, recipes
from .runtime import CompressedModel, Programs
from .spec import ModelSpec

__all__ = ["apply", "CompressedModel", "Budget", "Recipe", "recipes", "load_model", "export", "load"]
__version__ = "0.1.0"


def apply(
    model: nn.Module,
    budget: float | int | str = 1.0,
    recipe: str | Recipe = "snapkv",
    *,
    page_size: int = 16,
    prefill_chunk: int | None = None,
    compile=False,
) -> CompressedModel:
    """Return a ``CompressedModel`` whose attention runs over a compressed ragged per-head paged KV cache.

    Parameters
    ----------
    model: a ``CompressedModel`` (re-uses its captured graph: cheap), a transformers causal LM loaded with
        ``attn_implementation="sdpa"``, or an ``nn.Module`` with
        ``forward(input_ids [B, T], position_ids [B, T]) -> logits`` that calls
        ``F.scaled_dot_product_attention(..., is_causal=True)`` and declares ``num_layers``, ``num_heads``,
        ``num_kv_heads``, ``head_dim``. It is not modified.
    budget: fraction of the context's KV bytes in (0, 1], an int (average tokens per KV head), or a size per
        sequence such as ``"64MiB"``. ``1.0`` keeps everything.
    recipe: a name from ``kvcompile.recipes()`` or a ``Recipe``.
    page_size: tokens per page (P). Smaller pages waste less to rounding; larger pages read faster.
    prefill_chunk: prefill long prompts this many tokens at a time, compressing between chunks, so the cache
        peaks near budget + one chunk.
    compile: ``True`` sends the rewritten prefill and decode programs through ``torch.compile`` (Inductor,
        ``fullgraph=True``; decode with static shapes, in a CUDA graph on CUDA); a backend name or callable
        picks another backend.

    Example: ``kvcompile.apply(model, budget=0.25, recipe="adakv-snapkv")``.
    """
    budget = Budget.parse(budget)
    recipe = get_recipe(recipe)
    recipe.build()  # bad recipe parameters fail here, before any capture
    if recipe.scorer is None and not budget.is_full:
        raise ValueError(f"recipe {recipe.name!r} keeps every token; use budget=1.0 or pick a compressing recipe")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
    if isinstance(model, CompressedModel):  # re-target: same captured graph, new recipe or budget (no re-capture)
        if model.programs.captured is None:
            raise ValueError("this CompressedModel was loaded from an exported artifact and cannot be re-targeted")
        spec, captured, gen_config = model.spec, model.programs.captured, model.generation_config
    elif isinstance(model, nn.Module):
        spec = ModelSpec.from_model(model)
        captured, gen_config = capture(model, spec), getattr(model, "generation_config", None)
    else:
        raise TypeError(f"apply() takes an nn.Module, got {type(model).__name__}")
    programs = Programs.rewrite(captured, spec, compile=compile)
    return CompressedModel(
        programs, spec, recipe, budget, page_size=page_size, prefill_chunk=prefill_chunk, generation_config=gen_config,
        device=next(captured.parameters()).device,
    )


def load_model(name: str, **kwargs):
    """(model, tokenizer) for a short name such as ``"smollm2-135m"``; see ``kvcompile.models.load_model``."""
    from .models import load_model as _load

    return _load(name, **kwargs)
