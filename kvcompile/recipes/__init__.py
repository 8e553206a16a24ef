"""Named, versioned recipes: which scorer and allocator, with which parameters, reproduce a method.

A recipe is data. ``kvcompile.recipes()`` lists them; ``apply(..., recipe="snapkv")`` uses one by name, and a
``Recipe`` object can be passed directly for a custom pairing. Bump ``version`` whenever a recipe's behaviour
changes, so results that quote ``name@version`` stay comparable; ``recipes.fingerprint`` and its test make sure
it does. ``provenance`` says what evidence a recipe rests on, ``inferred`` what it fills in beyond that.
"""

from __future__ import annotations

from .builtin import RECIPES
from .recipe import PROVENANCE, Recipe

__all__ = ["DEFAULT", "PROVENANCE", "RECIPES", "Recipe", "WRAPPERS", "compose", "get_recipe", "in_format",
           "prefill_decoding", "recipes"]
DEFAULT = "snapkv"  # what ``kvcompile.apply`` compresses with when no recipe is named


def get_recipe(recipe: str | Recipe) -> Recipe:
    """A recipe by name, or a composition of wrappers and a recipe: ``"chunkkv+snapkv"`` (``recipes.compose``)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and "+" in recipe:
        from .compose import parse  # that module builds on Recipe and RECIPES

        return parse(recipe)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[recipe]


def recipes() -> dict[str, Recipe]:
    """All built-in recipes by name."""
    return dict(RECIPES)


# the resolvers of text a recipe names (recipes.anchors.resolve) and of ReCo's reflection markers
# (recipes.reflection.resolve), for a tokenizer; compositions build on the recipes above
from . import (  # noqa: E402
    anchors,
    reflection,
)
from .compose import WRAPPERS, compose, in_format, prefill_decoding  # noqa: E402

# ``kvcompile.recipes`` is this function at the top level: the resolvers the docs and errors name are reached from it
recipes.anchors, recipes.reflection = anchors, reflection
