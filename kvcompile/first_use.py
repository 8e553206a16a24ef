"""Weights too large to ship are trained where they are first needed. ``apply`` builds its recipe through
``build_recipe``: when the scorer finds no weights of a method in ``FIRST_USE``, for a model ``kvcompile.load_model``
knows by name, and none are pinned by digest, it says what it is doing and how long it takes, runs what
``kvcompile train METHOD --model NAME`` runs, once, and builds again from the weights it wrote
(``methods.learned.trained_root()``). ``KVCOMPILE_TRAIN_ON_FIRST_USE=0`` refuses instead, with the command to run.
"""

from __future__ import annotations

import os
import sys

from .methods import learned

FIRST_USE = {"fastkvzip": 8}  # method -> minutes the default run took for SmolLM2 on 2 busy CPU cores (docs/results.md)


def build_recipe(recipe):
    """``recipe.build()``, training missing first-use weights first (see the module)."""
    try:
        return recipe.build()
    except learned.MissingWeights as missing:
        from . import models

        if (missing.method not in FIRST_USE or missing.sha256 or missing.name not in models.REGISTRY
                or os.environ.get("KVCOMPILE_TRAIN_ON_FIRST_USE", "1") == "0"):
            raise
        method, name = missing.method, missing.name
    print(f"kvcompile: recipe {recipe.name!r} reads {method} weights for {name}, which are too large to ship; "
          f"training them now, once: `kvcompile train {method} --model {name}`, about {FIRST_USE[method]} minutes on "
          f"2 CPU cores, written to {learned.trained_root()} (KVCOMPILE_TRAIN_ON_FIRST_USE=0 refuses instead)",
          file=sys.stderr)
    from .models import load_model
    from .train import train

    train(method, *load_model(name), name=name)
    return recipe.build()
