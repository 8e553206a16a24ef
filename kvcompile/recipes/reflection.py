"""ReCo's reflection markers as a tokenizer spells them (``methods.step_units.ReCo``): the penalty matches token ids,
and methods import only torch, so this module fills the ids into a recipe::

    recipe = kvcompile.recipes.reflection.resolve("reco", tok, penalty=0.5)
"""

from __future__ import annotations

import dataclasses

from . import Recipe, get_recipe
from .anchors import anchor_ids

MARKERS = ("Wait", "let me re-check", "let me check", "double-check", "let me verify", "Hmm", "Actually")


def resolve(recipe: str | Recipe, tokenizer, penalty: float = 0.5, markers=MARKERS) -> Recipe:
    """``recipe`` (whose scorer must be ``reco``) with a reflection penalty of ``penalty`` on the steps that hold one
    of ``markers`` (as written, capitalised, after a space), named ``<name>+reflect``."""
    recipe = get_recipe(recipe)
    if recipe.scorer != "reco":
        raise ValueError(f"a reflection penalty is ReCo's: recipe {recipe.name!r} scores by {recipe.scorer!r}")
    args = recipe.scorer_args | {"reflection": anchor_ids(tokenizer, markers), "penalty": penalty}
    return dataclasses.replace(recipe, name=f"{recipe.name}+reflect", scorer_args=args)
