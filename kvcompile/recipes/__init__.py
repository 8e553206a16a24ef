"""Named, versioned recipes: which scorer and allocator, with which parameters, reproduce a method.

A recipe is data. ``kvcompile.recipes()`` lists them; ``apply(..., recipe="snapkv")`` uses one by name, and a
``Recipe`` object can be passed directly for a custom pairing. Bump ``version`` whenever a recipe's behaviour
changes, so results that quote ``name@version`` stay comparable; ``recipes.fingerprint`` and its test make sure
it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..methods import ALLOCATORS, SCORERS
from ..schedule import DecodeSchedule


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
    decode: dict | None = None  # ``schedule.DecodeSchedule`` fields: compress while generating (None: never)

    def __post_init__(self):
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"recipe {self.name!r}: unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"recipe {self.name!r}: unknown allocator {self.allocator!r}; known: {sorted(ALLOCATORS)}")
        if self.decode is not None:
            try:
                DecodeSchedule(**self.decode)
            except (TypeError, ValueError) as e:
                raise ValueError(f"recipe {self.name!r}: bad decode schedule: {e}") from e

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def fingerprint(self) -> str:
        """A hash of the behaviour fields and the code they run (``recipes.fingerprint``): it moves with any
        change of behaviour, so a test can insist that the version moves too."""
        from .fingerprint import fingerprint  # that module reads RECIPES, defined below

        return fingerprint(self)

    def build(self):
        """(scorer, allocator) instances; bad parameters raise here, before the model is touched."""
        try:
            scorer = SCORERS[self.scorer](**self.scorer_args) if self.scorer else None
            return scorer, ALLOCATORS[self.allocator](**self.allocator_args)
        except TypeError as e:  # an unknown or missing parameter name
            raise ValueError(f"recipe {self.name!r}: {e}") from e


# Version 2 (behaviour changed after the recipe was added, before versions were fingerprinted):
#   h2o, criticalkv: 2b142f9, ``merge_rankings`` returns the first criterion's values instead of negated ranks
#     (where those values tie, the tie now goes to the earlier token, not the better merged rank); CriticalKV's
#     two stages split only the tokens its base does not protect.
#   adakv-snapkv, adakv-expected-attention, kvzip: 25dfcbb, pinned tokens beyond a budget go round-robin between
#     heads (``pooled_rank``) instead of all to the first head.
#   adakv-criticalkv: both.
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
        "adakv-snapkv", "snapkv", "adakv", {"window": 32, "kernel": 7}, {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2407.11550",
    ),
    # scorers (prefill time); every one is query-agnostic: the context is compressed before the question is read
    Recipe("tova", "tova", scorer_args={"pool": "layer"}, source="https://arxiv.org/abs/2401.06104"),
    Recipe(
        "h2o", "h2o", scorer_args={"window": 8192, "block": 256, "heavy_ratio": 0.5}, version=2,
        source="https://arxiv.org/abs/2306.14048",
    ),
    Recipe("keydiff", "keydiff", source="https://arxiv.org/abs/2504.15364"),
    Recipe(
        "expected-attention", "expected-attention",
        scorer_args={"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
        source="https://arxiv.org/abs/2510.00636",
    ),
    Recipe(
        "adakv-expected-attention", "expected-attention", "adakv",
        {"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.01},
        {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2510.00636 (kvpress leaderboard pairing: AdaKV, epsilon 1e-2)",
    ),
    Recipe(
        "criticalkv", "criticalkv",
        scorer_args={
            "base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5,
        },
        version=2, source="https://arxiv.org/abs/2502.03805",
    ),
    Recipe(
        "adakv-criticalkv", "criticalkv", "adakv",
        {"base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2502.03805 (CriticalAdaKV)",
    ),
    Recipe(
        "compactor", "compactor",
        scorer_args={"sinks_start": 8, "sinks_end": 4, "chunk": 256, "sketch": 48, "blending": 0.35, "window": 8192},
        source="https://arxiv.org/abs/2507.08143",
    ),
    Recipe(
        "kvzip", "kvzip", "global-topk", {"n_sink": 4, "window": 8192}, version=2,
        source="https://arxiv.org/abs/2505.23416",
    ),
    Recipe(
        "jacap", "jacap", scorer_args={"tau": 10.0, "window": 512, "n_sink": 4}, source="https://arxiv.org/abs/2609.08131"
    ),
    Recipe(
        "twinkv", "twinkv", "twinkv", {"tau": 0.9, "local": 32, "lam": 1.0, "window": 32, "n_sink": 4}, {"floor": 0.2},
        source="https://arxiv.org/abs/2608.27128",
    ),
    # allocators (prefill time), with the scorer each paper pairs them with
    Recipe("contourkv", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "contour"},
           source="https://arxiv.org/abs/2608.25230 (inferred from the abstract)"),
    Recipe("contourkv-balancing", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "balancing"},
           source="https://arxiv.org/abs/2608.25230 (balancing variant, inferred)"),
    Recipe("certkv", "snapkv", "certkv", {"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2608.21541"),
    Recipe("page-entrokv", "page-entrokv", "page-entrokv", {"window": 32, "sinks": 4, "tau": 1.0},
           source="https://arxiv.org/abs/2610.03135"),
    Recipe("ripplekv", "snapkv", "ripplekv", {"window": 32, "kernel": 7}, {"ratio": 4.0},
           source="https://arxiv.org/abs/2608.08684 (uniform until methods.ripplekv.calibrate fills layer_sensitivity)"),
    Recipe("sgd-kv", "snapkv", "sgd-kv", {"window": 128, "kernel": 7}, {"reserve": 128},
           source="https://arxiv.org/abs/2609.03235 (uniform until methods.sgdkv.calibrate fills head_scores)"),
    Recipe("catekv", "catekv", "catekv",
           {"last_q": 64, "init": 64, "recent": 256, "chunk": 16, "top_threshold": 0.6, "top_fraction": 0.995},
           {"adaptive_fraction": 0.4, "consistent_share": 0.25},
           source="https://github.com/jhy-123/CateKV (ICML 2025); per-prompt CV test until calibrate fills adaptive_heads"),
    # decode time (kvcompile.schedule): the budget caps the cache while generating; the prefill scorer acts only
    # when the prompt alone is over the cap (SnapKV with a window of one query = the last query's attention)
    Recipe("inertiakv", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8}},
           source="https://arxiv.org/abs/2609.03515 (per-head EMA; evicts every 16 steps; window, sinks inferred)"),
    Recipe("inertiakv-lazy", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8, "refresh": 4}},
           source="https://arxiv.org/abs/2609.03515 (InertiaKV-Lazy4)"),
    Recipe("score-free", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "score-free", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2609.03515 (Score-Free; FIFO order of later tokens inferred)"),
    Recipe("random-attention", "random",
           decode={"policy": "random-attention", "every": 64, "recent": 64, "prompt": True},
           source="https://arxiv.org/abs/2609.03430 (random_pp: prompt + recent 64 kept, bursts of 64)"),
    Recipe("h2o-decode", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "h2o-decode", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2306.14048 (attention summed over generated steps, as awslabs/keys_values)"),
    Recipe("snapkv-decode", "snapkv", scorer_args={"window": 32, "kernel": 7},
           decode={"policy": "snapkv-decode", "every": 16, "recent": 32, "sinks": 4,
                   "args": {"window": 32, "kernel": 7}},
           source="https://arxiv.org/abs/2404.14469 (re-scored from the last 32 queries at every eviction)"),
    Recipe("growpage", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "growpage", "every": 16, "recent": 16, "sinks": 4},
           source="https://arxiv.org/abs/2609.03494 (betas, threshold, working set, floor, max_share inferred)"),
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
