"""kvcompile: compile-time KV-cache compression that really holds only its budget.

The path of one token: ``apply`` captures the model (``capture.capture``), reads its attention geometry
(``spec.ModelSpec``), rewrites the captured graph once into prefill and decode programs (``programs.Programs``,
``passes.rewrite``; their attention ops live in ``ops``) and returns a ``CompressedModel`` (``model``) over one
``cache.PagedKVCache``. ``CompressedModel.generate`` (``generation``) -> ``prefill``/``decode`` ->
``PagedKVCache.append`` says where the new tokens go -> ``Programs.run``: the ops write K/V into pages and attend
(``kernels``) -> ``compress.compress`` scores (``methods``), allocates and plans (``plan``), and the cache keeps the
plan (``PagedKVCache.keep``). ``export``/``load`` (``artifact``) ship the programs as AOTInductor packages.

Example::

    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.25)  # the default recipe; others: kvcompile.recipes()
    out = cm.generate(**tok("...", return_tensors="pt"), max_new_tokens=32)
    print(cm.cache_stats()["bytes_held"])
"""

from __future__ import annotations

from torch import nn

from . import adapters, checks, observation, ops
from .artifact import export, load
from .budget import Budget
from .kernels.formats import get_format
from .model import CompressedModel
from .programs import Programs
from .recipes import DEFAULT as DEFAULT_RECIPE
from .recipes import Recipe, get_recipe, recipes
from .spec import ModelSpec

__all__ = ["apply", "CompressedModel", "Budget", "Recipe", "recipes", "load_model", "export", "load"]
__version__ = "0.1.0"


def apply(
    model: nn.Module,
    budget: float | int | str = 1.0,
    recipe: str | Recipe = DEFAULT_RECIPE,
    *,
    page_size: int = 16,
    prefill_chunk: int | None = None,
    compile=False,
    capture_cache: bool | str = True,
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
    recipe: a name from ``kvcompile.recipes()``, a composition of names joined by ``+`` (a page format last
        stores what is kept in it: ``"full+fp8"``; docs/guide.md) or a ``Recipe``.
    page_size: tokens per page (P). Smaller pages waste less to rounding; larger pages read faster.
    prefill_chunk: prefill long prompts this many tokens at a time, compressing between chunks, so the cache
        peaks near budget + one chunk (default: the recipe's ``Recipe.prefill_chunk``).
    compile: ``True`` sends the rewritten prefill and decode programs through ``torch.compile`` (Inductor,
        ``fullgraph=True``; prefill with dynamic shapes; decode compiles once per batch size, in a CUDA graph on
        CUDA); a backend name or callable picks another backend.
    capture_cache: re-use the captured and rewritten programs of an earlier ``apply`` on a model with the same
        class, config, weight shapes and dtypes, and library versions, from a disk cache (``program_store``; a
        folder may be given); ``False`` captures afresh and stores nothing. ``KVCOMPILE_PROGRAM_CACHE=0`` turns
        it off for the process.

    Example: ``kvcompile.apply(model, budget=0.25, recipe=name)``, ``name`` from ``kvcompile.recipes()``
    (docs/methods.md says what each computes).
    """
    budget = Budget.parse(budget)
    recipe = get_recipe(recipe)
    scorer, _ = recipe.build()  # bad recipe parameters fail here, before any capture
    if scorer is not None:
        observation.check(scorer.sources(), f"recipe {recipe.name!r}")
    if recipe.scorer is None and recipe.format is None and not budget.is_full:
        raise ValueError(f"recipe {recipe.name!r} keeps every token; use budget=1.0 or pick a compressing recipe")
    ops.check_decode_backend(recipe.format, compile)
    checks.positive_int("page_size", page_size)
    checks.positive_int("prefill_chunk", prefill_chunk, allow_none=True)
    prefill_chunk = recipe.prefill_chunk if prefill_chunk is None else prefill_chunk
    if isinstance(model, CompressedModel):  # re-target: same programs, new recipe or budget (nothing rewritten)
        if model.programs.captured is None:
            raise ValueError("this CompressedModel was loaded from an exported artifact and cannot be re-targeted")
        checks.same_adapter(recipe, model.recipe)
        spec, programs, gen_config, source = model.spec, model.programs, model.generation_config, model.source
    elif isinstance(model, nn.Module):
        if recipe.adapter is not None:  # its LoRA weights, merged into a copy: the model given is not modified
            model = adapters.adapted(model, recipe.adapter)
        spec = ModelSpec.from_model(model)
        programs = Programs.of(model, spec, capture_cache)
        gen_config, source = getattr(model, "generation_config", None), model
    else:
        raise TypeError(f"apply() takes an nn.Module, got {type(model).__name__}")
    device = next(programs.captured.parameters()).device
    moments = model.latent_moments if isinstance(model, CompressedModel) else None
    if moments is None and recipe.format is not None and get_format(recipe.format).latent:
        from .calibration.latent import sampled_moments  # calibration runs the model: it sits above it

        full = CompressedModel(programs.compile(False), spec, get_recipe("full"), Budget.parse(1.0), device=device,
                               source=source)
        moments = sampled_moments(full)
    return CompressedModel(
        programs.compile(compile), spec, recipe, budget, page_size=page_size, prefill_chunk=prefill_chunk,
        generation_config=gen_config, device=device, source=source, latent_moments=moments,
    )


def load_model(name: str, **kwargs):
    """(model, tokenizer) for a short name such as ``"smollm2-135m"``; see ``kvcompile.models.load_model``."""
    from .models import load_model as _load

    return _load(name, **kwargs)
