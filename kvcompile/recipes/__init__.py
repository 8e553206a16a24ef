"""Named, versioned recipes: which scorer and allocator, with which parameters, reproduce a method.

A recipe is data. ``kvcompile.recipes()`` lists them; ``apply(..., recipe="snapkv")`` uses one by name, and a
``Recipe`` object can be passed directly for a custom pairing. Bump ``version`` whenever a recipe's behaviour
changes, so results that quote ``name@version`` stay comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..methods import ALLOCATORS, SCORERS


@dataclass(frozen=True)
class Recipe:
    name: str
    scorer: str | None  # None: nothing is ever evicted
    allocator: str = "uniform"
    scorer_args: dict = field(default_factory=dict)
    allocator_args: dict = field(default_factory=dict)
    version: int = 1
    source: str = ""
    query_aware: bool = False

    def __post_init__(self):
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"recipe {self.name!r}: unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"recipe {self.name!r}: unknown allocator {self.allocator!r}; known: {sorted(ALLOCATORS)}")

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"

    def build(self):
        """(scorer, allocator) instances; bad parameters raise here, before the model is touched."""
        try:
            scorer = SCORERS[self.scorer](**self.scorer_args) if self.scorer else None
            return scorer, ALLOCATORS[self.allocator](**self.allocator_args)
        except TypeError as e:  # an unknown or missing parameter name
            raise ValueError(f"recipe {self.name!r}: {e}") from e


_BUILTIN = [
    Recipe("full", None, source="no compression (reference)"),
    Recipe("random", "random", source="uniform random eviction (control)"),
    Recipe("streamingllm", "streamingllm", scorer_args={"sinks": 4}, source="https://arxiv.org/abs/2309.17453"),
    Recipe("knorm", "knorm", source="https://arxiv.org/abs/2406.11430"),
    Recipe("snapkv", "snapkv", scorer_args={"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2404.14469"),
    Recipe(
        "pyramidkv", "snapkv", "pyramid", {"window": 32, "kernel": 7}, {"beta": 20.0, "window": 32},
        source="https://arxiv.org/abs/2406.02069",
    ),
    Recipe(
        "adakv-snapkv", "snapkv", "adakv", {"window": 32, "kernel": 7}, {"alpha_safeguard": 0.2},
        source="https://arxiv.org/abs/2407.11550",
    ),
]
RECIPES: dict[str, Recipe] = {r.name: r for r in _BUILTIN}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[recipe]


def recipes() -> dict[str, Recipe]:
    """All built-in recipes by name."""
    return dict(RECIPES)
