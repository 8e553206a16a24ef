"""Named, versioned recipes: which scorer and allocator, with which parameters, reproduce a method.

A recipe is data. ``kvcompile.recipes()`` lists them; ``apply(..., recipe="snapkv")`` uses one by name, and a
``Recipe`` object can be passed directly for a custom pairing. Bump ``version`` whenever a recipe's behaviour
changes, so results that quote ``name@version`` stay comparable; ``recipes.fingerprint`` and its test make sure
it does. ``provenance`` says what evidence a recipe rests on, ``inferred`` what it fills in beyond that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..methods import ALLOCATORS, SCORERS
from ..schedule import DecodeSchedule

PROVENANCE = {  # the strongest evidence a recipe rests on
    "official-code": "the method's official implementation was read",
    "paper": "the full paper was read",
    "abstract": "the paper itself was not read: its abstract, at most a third-party summary; details inferred",
    "peer": "reproduces a peer library's implementation (kvpress, awslabs/keys_values)",
    "control": "a baseline or control, no paper",
    "custom": "not a built-in recipe: no claim made",
}


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
    provenance: str = "custom"  # a key of PROVENANCE
    inferred: str = ""  # what the recipe fills in beyond its evidence ("" = nothing)

    def __post_init__(self):
        if self.provenance not in PROVENANCE:
            raise ValueError(f"recipe {self.name!r}: provenance {self.provenance!r} is not one of {list(PROVENANCE)}")
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"recipe {self.name!r}: unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"recipe {self.name!r}: unknown allocator {self.allocator!r}; known: {sorted(ALLOCATORS)}")
        if self.decode is not None:
            try:
                DecodeSchedule(**self.decode)
            except (TypeError, ValueError) as e:
                raise ValueError(f"recipe {self.name!r}: bad decode schedule: {e}") from e

    def __str__(self) -> str:
        decode = f" + decode {self.decode['policy']}" if self.decode else ""
        inferred = f"; inferred: {self.inferred}" if self.inferred else ""
        methods = f"{self.scorer or 'nothing evicted'} + {self.allocator}{decode}"
        return f"{self.tag}: {methods} ({self.provenance}{inferred})"

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


_SNAPKV_WINDOW = "window 32 and a max-pool of 7 instead of kvpress's 64 and average of 5"
_POST_ROPE_STATS = "query mean and covariance from the last 512 post-RoPE queries; kvpress: pre-RoPE ones, rotated"
_CRITICAL = "the L1 norm of v for that of W_o v, as scorers see no weights; the two stages merged into one ranking"
_INERTIA = "the method from a full-text summary; per-(layer, head) state; evicts every 16 steps, recent 32, 4 sinks"

# Version 2 (behaviour changed after the recipe was added, before versions were fingerprinted):
#   h2o, criticalkv: 2b142f9, ``merge_rankings`` returns the first criterion's values instead of negated ranks
#     (where those values tie, the tie now goes to the earlier token, not the better merged rank); CriticalKV's
#     two stages split only the tokens its base does not protect.
#   adakv-snapkv, adakv-expected-attention, kvzip: 25dfcbb, pinned tokens beyond a budget go round-robin between
#     heads (``pooled_rank``) instead of all to the first head.
#   adakv-criticalkv: both.
# Version 3:
#   kvzip: the reconstruction replays every token read since the last compression (with prefill_chunk, chunks that
#     fit the budget are reconstructed with the next one), not only the chunk just read.
_BUILTIN = [
    Recipe("full", None, source="no compression (reference)", provenance="control"),
    Recipe("random", "random", source="uniform random eviction (control)", provenance="control"),
    Recipe("streamingllm", "streamingllm", scorer_args={"sinks": 4}, source="https://arxiv.org/abs/2309.17453",
           provenance="peer"),
    Recipe("knorm", "knorm", source="https://arxiv.org/abs/2406.11430", provenance="peer"),
    Recipe("snapkv", "snapkv", scorer_args={"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2404.14469",
           provenance="peer", inferred=_SNAPKV_WINDOW),
    Recipe(
        "pyramidkv", "snapkv", "pyramid", {"window": 32, "kernel": 7}, {"beta": 20.0, "window": 32},
        source="https://arxiv.org/abs/2406.02069", provenance="peer", inferred=_SNAPKV_WINDOW,
    ),
    Recipe(
        "adakv-snapkv", "snapkv", "adakv", {"window": 32, "kernel": 7}, {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2407.11550", provenance="peer", inferred=_SNAPKV_WINDOW,
    ),
    # scorers (prefill time); every one is query-agnostic: the context is compressed before the question is read
    Recipe("tova", "tova", scorer_args={"pool": "layer"}, source="https://arxiv.org/abs/2401.06104",
           provenance="peer", inferred="ranked once after prefill, as kvpress does, not once per decoding step"),
    Recipe(
        "h2o", "h2o", scorer_args={"window": 8192, "block": 256, "heavy_ratio": 0.5}, version=2,
        source="https://arxiv.org/abs/2306.14048 (as awslabs/keys_values)", provenance="peer",
        inferred="ranked once after prefill by every prefill query, not greedily per decoding step; the heavy and "
                 "recent halves merged into one ranking",
    ),
    Recipe("keydiff", "keydiff", source="https://arxiv.org/abs/2504.15364", provenance="peer",
           inferred="the paper's block-wise eviction only with apply(prefill_chunk=...)"),
    Recipe(
        "expected-attention", "expected-attention",
        scorer_args={"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
        source="https://arxiv.org/abs/2510.00636", provenance="peer", inferred=_POST_ROPE_STATS,
    ),
    Recipe(
        "adakv-expected-attention", "expected-attention", "adakv",
        {"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.01},
        {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2510.00636 (kvpress leaderboard pairing: AdaKV, epsilon 1e-2)",
        provenance="peer", inferred=_POST_ROPE_STATS,
    ),
    Recipe(
        "criticalkv", "criticalkv",
        scorer_args={
            "base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5,
        },
        version=2, source="https://arxiv.org/abs/2502.03805", provenance="peer", inferred=_CRITICAL,
    ),
    Recipe(
        "adakv-criticalkv", "criticalkv", "adakv",
        {"base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"alpha_safeguard": 0.2}, version=2,
        source="https://arxiv.org/abs/2502.03805 (CriticalAdaKV)", provenance="peer", inferred=_CRITICAL,
    ),
    Recipe(
        "compactor", "compactor",
        scorer_args={"sinks_start": 8, "sinks_end": 4, "chunk": 256, "sketch": 48, "blending": 0.35, "window": 8192},
        source="https://arxiv.org/abs/2507.08143", provenance="peer",
        inferred="post-RoPE keys; blending fixed at 0.35, where kvpress uses the compression ratio; z-scores per head",
    ),
    Recipe(
        "kvzip", "kvzip", "global-topk", {"n_sink": 4, "window": 8192}, version=3,
        source="https://arxiv.org/abs/2505.23416", provenance="peer",
        inferred="no 'Repeat the previous context' instruction, as scorers have no tokenizer; one reconstruction chunk",
    ),
    Recipe(
        "jacap", "jacap", scorer_args={"tau": 10.0, "window": 512, "n_sink": 4}, source="https://arxiv.org/abs/2609.08131",
        provenance="abstract",
        inferred="the formulas from a full-text summary; the attention prior, query variance and weight scale as in "
                 "CapKV's kvpress code",
    ),
    Recipe(
        "twinkv", "twinkv", "twinkv", {"tau": 0.9, "local": 32, "lam": 1.0, "window": 32, "n_sink": 4}, {"floor": 0.2},
        source="https://arxiv.org/abs/2608.27128", provenance="abstract",
        inferred="v2 abstract with v1 details: the discount 1/(1 + lam f), prefix attention, capacities proportional "
                 "to it with a 0.2 floor",
    ),
    Recipe("qfilter", "qfilter", scorer_args={"window": 512},
           source="https://arxiv.org/abs/2503.02812 (per-prompt filters until calibration.qfilter.calibrate fills "
                  "filters)", provenance="peer",
           inferred="filters = the first right-singular vector of the model's own post-RoPE queries, signed along "
                    "them and scored +<u, k> (kvpress downloads published filters and scores -<f, k>); uncalibrated, "
                    "each prompt's last 512 queries"),
    Recipe("finch", "finch", scorer_args={"normalize_scores": True, "window": 8192}, query_aware=True,
           source="https://doi.org/10.1162/tacl_a_00716", provenance="peer",
           inferred="the question is generate's input_ids after context_ids (no delimiter token), at most its last "
                    "8192 tokens; keys are not re-rotated (kvpress: rerotate_keys=True): positions stay original, "
                    "and ragged heads would need a position offset each"),
    Recipe("kvcompose", "kvcompose", "kvcompose",
           {"agg_task": "max", "agg_group": "mean", "add_v_norm": False, "add_mean_across_heads": True,
            "window": 8192},
           {"structured": True, "agg_head": "mean", "keep_token_lower_bound": 0},
           source="https://arxiv.org/abs/2509.05165", provenance="peer",
           inferred="the second pass is a context reconstruction (the context alone, its tokens dropped after); the "
                    "one-token floor per layer comes out of the budget, not on top of it"),
    # allocators (prefill time), with the scorer each paper pairs them with
    Recipe("contourkv", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "contour"},
           source="https://arxiv.org/abs/2608.25230", provenance="abstract",
           inferred="the per-head mass curve, the shared level and its exact solution; pins spread evenly"),
    Recipe("contourkv-balancing", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "balancing"},
           source="https://arxiv.org/abs/2608.25230 (balancing variant)", provenance="abstract",
           inferred="'balancing' read as equal marginal mass, i.e. the least total dropped mass"),
    Recipe("certkv", "snapkv", "certkv", {"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2608.21541",
           provenance="abstract",
           inferred="the method from third-party full-text reads; the summary row's key is our construction; a head "
                    "evicting one token keeps it"),
    Recipe("page-entrokv", "page-entrokv", "page-entrokv", {"window": 32, "sinks": 4, "tau": 1.0},
           source="https://arxiv.org/abs/2610.03135", provenance="abstract",
           inferred="the observed queries (last 32), 4 sinks, tau 1 from unofficial code; its layer budgets and "
                    "anchor pages left out"),
    Recipe("ripplekv", "snapkv", "ripplekv", {"window": 32, "kernel": 7}, {"ratio": 4.0},
           source="https://arxiv.org/abs/2608.08684 (uniform until calibration.ripplekv.calibrate fills layer_sensitivity)",
           provenance="abstract",
           inferred="the noise, 0.5 x RMS Gaussian; the KL; min-max normalisation; ratio 4; the calibration text"),
    Recipe("sgd-kv", "snapkv", "sgd-kv", {"window": 128, "kernel": 7}, {"reserve": 128},
           source="https://arxiv.org/abs/2609.03235 (uniform until calibration.sgdkv.calibrate fills head_scores)",
           provenance="abstract",
           inferred="the method from a full-text summary; a teacher-forced diagnostic, token-level matching, "
                    "reserve 128"),
    Recipe("catekv", "catekv", "catekv",
           {"last_q": 64, "init": 64, "recent": 256, "chunk": 16, "top_threshold": 0.6, "top_fraction": 0.995},
           {"adaptive_fraction": 0.4, "consistent_share": 0.25},
           source="https://github.com/jhy-123/CateKV (ICML 2025)",
           provenance="official-code",
           inferred="consistent heads keep 0.25 of the uniform share, where the paper keeps adaptive heads full; "
                    "a per-prompt CV test until calibration.catekv.calibrate fills adaptive_heads"),
    # decode time (kvcompile.schedule): the budget caps the cache while generating; the prefill scorer acts only
    # when the prompt alone is over the cap (SnapKV with a window of one query = the last query's attention)
    Recipe("inertiakv", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8}},
           source="https://arxiv.org/abs/2609.03515 (per-head EMA)", provenance="abstract",
           inferred=_INERTIA + "; new tokens start at 0"),
    Recipe("inertiakv-lazy", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8, "refresh": 4}},
           source="https://arxiv.org/abs/2609.03515 (InertiaKV-Lazy4)", provenance="abstract", inferred=_INERTIA),
    Recipe("score-free", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "score-free", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2609.03515 (Score-Free)", provenance="abstract",
           inferred=_INERTIA + "; later tokens FIFO, newest first"),
    Recipe("random-attention", "random",
           decode={"policy": "random-attention", "every": 64, "recent": 64, "prompt": True},
           source="https://arxiv.org/abs/2609.03430 (random_pp: prompt + recent 64 kept, bursts of 64)",
           provenance="official-code", inferred="the recent window outranks the prompt when both do not fit"),
    Recipe("h2o-decode", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "h2o-decode", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2306.14048 (attention summed over generated steps, as awslabs/keys_values)",
           provenance="peer", inferred="the grace period is the recent window of 32; evicts every 16 steps"),
    Recipe("snapkv-decode", "snapkv", scorer_args={"window": 32, "kernel": 7},
           decode={"policy": "snapkv-decode", "every": 16, "recent": 32, "sinks": 4,
                   "args": {"window": 32, "kernel": 7}},
           source="https://arxiv.org/abs/2404.14469 (re-scored from the last 32 queries at every eviction)",
           provenance="abstract",
           inferred="SnapKV re-applied at every eviction as R-KV-style decode baselines describe it; no code read"),
    Recipe("growpage", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "growpage", "every": 16, "recent": 16, "sinks": 4},
           source="https://arxiv.org/abs/2609.03494", provenance="abstract",
           inferred="the method from a full-text summary; betas, working set, threshold, floor, max_share, "
                    "token-level eviction"),
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
