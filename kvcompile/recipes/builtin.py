"""The built-in recipes, in the order ``kvcompile.recipes()`` lists them. Bump a recipe's ``version`` whenever its
behaviour changes (``recipes.fingerprint`` checks it) and say what changed in ``docs/recipe_versions.md``."""

from __future__ import annotations

from .learned import LEARNED
from .page_formats import FORMAT_RECIPES
from .recipe import Recipe

_SNAPKV_WINDOW = "window 32 and a max-pool of 7 instead of kvpress's 64 and average of 5"
_POST_ROPE_STATS = "query mean and covariance from the last 512 queries (rotated back before RoPE); kvpress: every one"
_CRITICAL = "the two stages merged into one ranking (each top-k holds about the first stage's share)"
_INERTIA = "the method from a full-text summary; per-(layer, head) state; evicts every 16 steps, recent 32, 4 sinks"

_BUILTIN = [
    Recipe("full", None, source="no compression (reference)", provenance="control"),
    Recipe("random", "random", version=2, source="uniform random eviction (control)", provenance="control"),
    Recipe("streamingllm", "streamingllm", version=2,
           scorer_args={"sinks": 4}, source="https://arxiv.org/abs/2309.17453",
           provenance="peer"),
    Recipe("knorm", "knorm", version=2, source="https://arxiv.org/abs/2406.11430", provenance="peer"),
    Recipe("snapkv", "snapkv", version=2,
           scorer_args={"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2404.14469",
           provenance="peer", inferred=_SNAPKV_WINDOW),
    Recipe("dapq", "dapq", scorer_args={"window": 32, "kernel": 7}, source="https://arxiv.org/abs/2603.11564",
           provenance="abstract",
           inferred="the pseudo tokens are the context's last 32 tokens again, at the next 32 positions; SnapKV's "
                    "aggregation and budgets over their queries"),
    Recipe(
        "pyramidkv", "snapkv", "pyramid", {"window": 32, "kernel": 7}, {"beta": 20.0, "window": 32},
        version=2, source="https://arxiv.org/abs/2406.02069", provenance="peer",
        inferred=_SNAPKV_WINDOW + "; a pyramid at any length (kvpress: SnapKV's budget below beta x window / budget)",
    ),
    Recipe(
        "adakv-snapkv", "snapkv", "adakv", {"window": 32, "kernel": 7}, {"alpha_safeguard": 0.2}, version=3,
        source="https://arxiv.org/abs/2407.11550", provenance="peer", inferred=_SNAPKV_WINDOW,
    ),
    # scorers (prefill time); every one is query-agnostic: the context is compressed before the question is read
    Recipe("tova", "tova", version=2, scorer_args={"pool": "layer"}, source="https://arxiv.org/abs/2401.06104",
           provenance="peer", inferred="ranked once after prefill, as kvpress does, not once per decoding step"),
    Recipe(
        "h2o", "h2o", scorer_args={"window": 8192, "block": 256, "heavy_ratio": 0.5}, version=3,
        source="https://arxiv.org/abs/2306.14048 (as awslabs/keys_values)", provenance="peer",
        inferred="ranked once after prefill by every prefill query, not greedily per decoding step; the heavy and "
                 "recent halves merged into one ranking",
    ),
    Recipe("keydiff", "keydiff", version=2, source="https://arxiv.org/abs/2504.15364", provenance="peer",
           inferred="the paper's block-wise eviction only with apply(prefill_chunk=...)"),
    Recipe(
        "expected-attention", "expected-attention",
        version=3, scorer_args={"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
        source="https://arxiv.org/abs/2510.00636", provenance="peer", inferred=_POST_ROPE_STATS,
    ),
    Recipe(
        "adakv-expected-attention", "expected-attention", "adakv",
        {"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.01},
        {"alpha_safeguard": 0.2}, version=4,
        source="https://arxiv.org/abs/2510.00636 (kvpress leaderboard pairing: AdaKV, epsilon 1e-2)",
        provenance="peer", inferred=_POST_ROPE_STATS,
    ),
    Recipe(
        "criticalkv", "criticalkv",
        scorer_args={
            "base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5,
        },
        version=4, source="https://arxiv.org/abs/2502.03805", provenance="peer", inferred=_CRITICAL,
    ),
    Recipe(
        "adakv-criticalkv", "criticalkv", "adakv",
        {"base": "snapkv", "base_args": {"window": 32, "kernel": 7}, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"alpha_safeguard": 0.2}, version=4,
        source="https://arxiv.org/abs/2502.03805 (CriticalAdaKV)", provenance="peer", inferred=_CRITICAL,
    ),
    Recipe(
        "compactor", "compactor",
        scorer_args={"sinks_start": 8, "sinks_end": 4, "chunk": 256, "sketch": 48, "blending": 0.35, "window": 8192},
        version=4, source="https://arxiv.org/abs/2507.08143", provenance="peer",
        inferred="blending fixed at 0.35, where kvpress uses the compression ratio; z-scores per head",
    ),
    Recipe(
        "kvzip", "kvzip", "global-topk", {"n_sink": 4, "window": 8192}, {"whole_pages": True}, version=5,
        source="https://arxiv.org/abs/2505.23416", provenance="peer",
        inferred="no 'Repeat the previous context' instruction (scorers have no tokenizer); one chunk; whole pages",
    ),
    Recipe(
        "kvgrad", "kvgrad", "global-topk", {"n_sink": 4, "window": 8192}, {"whole_pages": True}, version=2,
        source="https://openreview.net/forum?id=cg1wTCJjjk (kvpress KVgradPress)", provenance="peer",
        inferred="KVzip's one reconstruction chunk with no instruction (kvpress: 512-token chunks after 'Repeat the "
                 "previous context' prompts); the backward through the source model; whole pages compete",
    ),
    Recipe(
        "kvzip-plus", "kvzip-plus", "global-topk", {"n_sink": 4, "window": 8192}, {"whole_pages": True},
        source="https://arxiv.org/abs/2601.07891 (KVzip+: kvpress kvzip_plus_normalization)",
        provenance="peer",
        inferred="KVzip's one reconstruction chunk with no instruction (kvpress: chunks after 'Repeat the previous "
                 "context' prompts); the probes' input norms from a dense pass of the source model; whole pages "
                 "compete",
    ),
    *LEARNED,  # kvzap, dms: weights trained here (recipes.learned)
    Recipe(
        "jacap", "jacap", version=2,
        scorer_args={"tau": 10.0, "window": 512, "n_sink": 4}, source="https://arxiv.org/abs/2609.08131",
        provenance="abstract",
        inferred="the formulas from a full-text summary; the attention prior, query variance and weight scale as in "
                 "CapKV's kvpress code",
    ),
    Recipe(
        "twinkv", "twinkv", "twinkv", {"tau": 0.9, "local": 32, "lam": 1.0, "window": 32, "n_sink": 4}, {"floor": 0.2},
        version=2, source="https://arxiv.org/abs/2608.27128", provenance="abstract",
        inferred="v2 abstract with v1 details: the discount 1/(1 + lam f), prefix attention, capacities proportional "
                 "to it with a 0.2 floor",
    ),
    # kvpress presses under their kvpress names and defaults (docs/methods_scorers.md)
    Recipe(
        "observed-attention", "observed-attention", version=2, scorer_args={"window": 8192, "block": 256},
        source="https://arxiv.org/abs/2306.14048 (kvpress ObservedAttentionPress)", provenance="peer",
        inferred="the last 8192 prompt queries (kvpress: every one); a query outside a sliding window is not counted",
    ),
    Recipe(
        "lagkv", "lagkv", version=2, scorer_args={"n_sink": 4, "lag_size": 128, "cross_scoring": False},
        source="https://arxiv.org/abs/2504.04704", provenance="peer",
        inferred="partitions in each head's held order; a zero reference range divided by 1e-6 instead of NaN",
    ),
    Recipe(
        "noncausal-attention", "noncausal-attention", version=2, scorer_args={"chunk": 256, "window": 8192},
        source="https://arxiv.org/abs/2507.08143 (Compactor's attention component)", provenance="peer",
        inferred="the last 8192 post-RoPE queries; scaled logits, masked chunk padding, smoothing and z-scores over "
                 "each head's held tokens (kvpress: unscaled, padding leaks mass, z over the layer)",
    ),
    Recipe(
        "leverage-score", "leverage-score", version=3, scorer_args={"sketch": 48, "seed": 0},
        source="https://arxiv.org/abs/2507.08143 (Compactor's leverage component)", provenance="peer",
        inferred="a seeded sketch per layer and head; a 1e-9 ridge, not 1e-2 Cholesky jitter; "
                 "z-scores per head",
    ),
    Recipe(
        "cur", "cur",
        version=2, scorer_args={"num_sinks": 4, "leverage_type": "kv_product", "use_random_leverage": False,
                     "use_local_approximation": True, "local_window_size": 16},
        source="https://arxiv.org/abs/2509.15038", provenance="peer",
        inferred="windows in each head's held order; a window of zero energy scores 0 instead of NaN",
    ),
    Recipe(
        "cappress", "cappress", version=3,
        scorer_args={"tau": 5.0, "window": 512, "n_sink": 4, "epsilon": 1e-6},
        source="https://arxiv.org/abs/2604.25975 (kvpress CapPress)", provenance="peer",
        inferred="query anchor = mean of the last 512 queries (rotated back before RoPE); kvpress: of every one",
    ),
    Recipe("qfilter", "qfilter", version=2, scorer_args={"window": 512},
           source="https://arxiv.org/abs/2503.02812 (per-prompt filters until calibration.qfilter.calibrate fills "
                  "filters)", provenance="peer",
           inferred="filters = the first right-singular vector of the model's own post-RoPE queries, signed along "
                    "them and scored +<u, k> (kvpress downloads published filters and scores -<f, k>); uncalibrated, "
                    "each prompt's last 512 queries"),
    Recipe("finch", "finch", version=2, scorer_args={"normalize_scores": True, "window": 8192}, query_aware=True,
           source="https://doi.org/10.1162/tacl_a_00716", provenance="peer",
           inferred="the question is generate's input_ids after context_ids (no delimiter token), at most its last "
                    "8192 tokens; keys keep their positions (kvpress: rerotate_keys=True, which is "
                    "'key-rerotation+finch' here)"),
    Recipe("kvcompose", "kvcompose", "kvcompose",
           {"agg_task": "max", "agg_group": "mean", "add_v_norm": False, "add_mean_across_heads": True,
            "window": 8192},
           {"structured": True, "agg_head": "mean", "keep_token_lower_bound": 0, "whole_pages": True},
           version=3, source="https://arxiv.org/abs/2509.05165", provenance="peer",
           inferred="the second pass is a context reconstruction (the context alone, its tokens dropped after); "
                    "layers compete for whole pages, each floored at one page out of the budget (kvpress: a token)"),
    Recipe("lukv", "expected-attention", "lukv",
           {"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.02}, version=2,
           source="https://arxiv.org/abs/2602.08585 (kvpress LUKVPress; uniform until calibration.lukv.calibrate "
                  "fills curve)", provenance="peer",
           inferred="the curve generation (future-attention utility of each head's ranking, greedy over concave "
                    "majorants, averaged over texts); counts rescaled to spend the byte budget exactly; the newest "
                    "token is not pinned (kvpress: window=1); " + _POST_ROPE_STATS),
    # allocators (prefill time), with the scorer each paper pairs them with
    Recipe("contourkv", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "contour"},
           version=2, source="https://arxiv.org/abs/2608.25230", provenance="abstract",
           inferred="the per-head mass curve, the shared level and its exact solution; pins spread evenly"),
    Recipe("contourkv-balancing", "snapkv", "contourkv", {"window": 32, "kernel": 7}, {"variant": "balancing"},
           version=2, source="https://arxiv.org/abs/2608.25230 (balancing variant)", provenance="abstract",
           inferred="'balancing' read as equal marginal mass, i.e. the least total dropped mass"),
    Recipe("certkv", "snapkv", "certkv", {"window": 32, "kernel": 7}, version=3,
           source="https://arxiv.org/abs/2608.21541", provenance="abstract",
           inferred="the method from third-party full-text reads; the summary's log-weight (the tail's mass for the "
                    "mean window query) is our choice, the paper leaves a mass term open; a head evicting one token "
                    "keeps it"),
    Recipe("attention-matching", "reconstruction-queries", "attention-matching", {"n_sink": 4, "window": 8192},
           {"references": 512}, source="https://arxiv.org/abs/2602.16284 (Attention Matching)", provenance="abstract",
           inferred="from the abstract and third-party summaries of the method (its code was not read): reference "
                    "queries from KVzip's reconstruction of the context (the paper's repeat-prefill, without its "
                    "instruction; 512 of its queries, evenly spaced), read once for every layer from the "
                    "uncompressed model (the paper builds them layer by layer on the compacted cache); keys the "
                    "highest-RMS-attention subset; non-negative least squares by 300 accelerated projected-gradient "
                    "steps; values by least squares with a 1e-4 relative ridge; every head the same number of "
                    "entries; KVzip's 4 sinks kept as they are", version=2),
    Recipe("gracekv", "snapkv", "gracekv", {"window": 32, "kernel": 7}, {"slot": 64, "beta": 0.1},
           source="https://arxiv.org/abs/2608.07001", provenance="abstract",
           inferred="the method from a full-text summary (no code): fixed slots of 64 tokens instead of the "
                    "curvature segmentation (no hidden states here); binary trees of contiguous halves instead of "
                    "hierarchical clustering; post-RoPE mean keys (methods see no RoPE to undo); relevance = SnapKV's "
                    "window attention, no graph propagation; head sensitivity 1; split gain R_p D_p - sum R_c D_c; "
                    "SnapKV's pinned window kept exactly; distortion on the 8 newest window queries"),
    Recipe("gracekv-unmerged", "snapkv", "gracekv", {"window": 32, "kernel": 7},
           {"slot": 64, "beta": 0.1, "merged": False}, source="gracekv's allocation without merging (control)",
           provenance="control", inferred="each prototype replaced by its most relevant token, unweighted"),
    Recipe("core", "snapkv", "core", {"window": 32, "kernel": 7}, {"memory": 4, "gamma": 1.0, "delta": 0.1},
           version=2, source="https://arxiv.org/abs/2610.02235", provenance="abstract",
           inferred="from the abstract and a third-party summary: the learned indexer replaced by its offline "
                    "objective computed exactly (SnapKV's mass + gamma x log-det of the kept unit keys' Gram + delta "
                    "I, greedy); the latent memory replaced by 4 weighted entries a head, equal-mass groups of the "
                    "evicted tokens in position order, exact for the mean window query; gamma 1, delta 0.1"),
    Recipe("core-unmerged", "snapkv", "core", {"window": 32, "kernel": 7},
           {"memory": 4, "gamma": 1.0, "delta": 0.1, "merged": False}, version=2,
           source="core's retention without its memory entries (control)", provenance="control"),
    Recipe("page-entrokv", "page-entrokv", "page-entrokv", {"window": 32, "sinks": 4, "tau": 1.0},
           version=2, source="https://arxiv.org/abs/2610.03135", provenance="abstract",
           inferred="the observed queries (last 32), 4 sinks, tau 1 from unofficial code; its layer budgets and "
                    "anchor pages left out"),
    Recipe("ripplekv", "snapkv", "ripplekv", {"window": 32, "kernel": 7}, {"ratio": 4.0},
           source="https://arxiv.org/abs/2608.08684 (uniform until calibration.ripplekv.calibrate fills "
                  "layer_sensitivity)",
           version=2, provenance="abstract",
           inferred="the noise, 0.5 x RMS Gaussian; the KL; min-max normalisation; ratio 4; the calibration text"),
    Recipe("sgd-kv", "snapkv", "sgd-kv", {"window": 128, "kernel": 7}, {"reserve": 128},
           source="https://arxiv.org/abs/2609.03235 (uniform until calibration.sgdkv.calibrate fills head_scores)",
           version=2, provenance="abstract",
           inferred="the method from a full-text summary; a teacher-forced diagnostic, token-level matching, "
                    "reserve 128"),
    Recipe("catekv", "catekv", "catekv",
           {"last_q": 64, "init": 64, "recent": 256, "chunk": 16, "top_threshold": 0.6, "top_fraction": 0.995},
           {"adaptive_fraction": 0.4, "consistent_share": 0.25},
           version=2, source="https://github.com/jhy-123/CateKV (ICML 2025)",
           provenance="official-code",
           inferred="consistent heads keep 0.25 of the uniform share, where the paper keeps adaptive heads full; "
                    "a per-prompt CV test until calibration.catekv.calibrate fills adaptive_heads"),
    # structure: heads judged local keep sinks + recent, the budget they leave goes to the others
    # (docs/methods_allocators.md#heads-that-stream)
    Recipe("simlayerkv", "simlayerkv", "fill-eligible",
           {"tau": 0.9, "sinks": 4, "recent": 64, "last": 1,
            "base": "snapkv", "base_args": {"window": 32, "kernel": 7}},
           version=2, source="https://arxiv.org/abs/2410.13846 (kvpress SimLayerKVPress)", provenance="peer",
           inferred="recent 64 for 1k contexts (kvpress: 1024), tau 0.9 (the paper's Llama-3 value); decided per "
                    "sequence, not averaged over the batch; under a budget the other layers rank by SnapKV and share "
                    "what lazy layers leave (kvpress keeps them whole); prefill only"),
    Recipe("duoattention", "duoattention", "fill-eligible",
           {"streaming": 0.5, "sinks": 4, "recent": 64, "base": "snapkv", "base_args": {"window": 32, "kernel": 7}},
           source="https://arxiv.org/abs/2410.10819 (kvpress DuoAttentionPress; per-prompt head scores until "
                  "calibration.duoattention.calibrate fills head_scores)", provenance="peer", version=2,
           inferred="a head's score is its output error under the streaming mask on offline text, not a trained "
                    "gate; sinks 4 and recent 64 for 1k contexts (paper: 128 and 256); half the heads stream; "
                    "retrieval heads rank by SnapKV within the budget; prefill only"),
    Recipe("headwisekv", "headwisekv", "fill-eligible", {"sinks": 4, "base": "streamingllm", "base_args": {"sinks": 4}},
           source="https://arxiv.org/abs/2609.02029 (HeadWiseKV / SeqCalib; every window the whole context until "
                  "calibration.headwisekv.calibrate fills windows)", provenance="abstract",
           inferred="from a full-text summary: the levels (fractions of the context, not 8K/16K/32K), 4 sinks, "
                    "SeqCalib's criterion (output error removed per token, greedy under each layer's share of the "
                    "aggregate budget, not a similarity floor per head); applies to every layer, sliding ones cost "
                    "only their window; prefill only"),
    # decode time (kvcompile.schedule): the budget caps the cache while generating; the prefill scorer acts only
    # when the prompt alone is over the cap (SnapKV with a window of one query = the last query's attention)
    Recipe("inertiakv", "snapkv", version=2, scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8}},
           source="https://arxiv.org/abs/2609.03515 (per-head EMA)", provenance="abstract",
           inferred=_INERTIA + "; new tokens start at 0"),
    Recipe("inertiakv-lazy", "snapkv", version=2, scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "inertiakv", "every": 16, "recent": 32, "sinks": 4, "args": {"alpha": 0.8, "refresh": 4}},
           source="https://arxiv.org/abs/2609.03515 (InertiaKV-Lazy4)", provenance="abstract", inferred=_INERTIA),
    Recipe("score-free", "snapkv", version=2, scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "score-free", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2609.03515 (Score-Free)", provenance="abstract",
           inferred=_INERTIA + "; later tokens FIFO, newest first"),
    Recipe("random-attention", "random",
           version=2, decode={"policy": "random-attention", "every": 64, "recent": 64, "prompt": True},
           source="https://arxiv.org/abs/2609.03430 (random_pp: prompt + recent 64 kept, bursts of 64)",
           provenance="official-code", inferred="the recent window outranks the prompt when both do not fit"),
    Recipe("h2o-decode", "snapkv", version=2, scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "h2o-decode", "every": 16, "recent": 32, "sinks": 4},
           source="https://arxiv.org/abs/2306.14048 (attention summed over generated steps, as awslabs/keys_values)",
           provenance="peer", inferred="the grace period is the recent window of 32; evicts every 16 steps"),
    Recipe("cam", "snapkv", scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "cam", "every": 16, "recent": 32, "sinks": 4, "args": {"merge_budget": 32, "seed": 0}},
           source="https://openreview.net/forum?id=LCTmppB165 (CaM, ICML 2024, as kvpress 0.5.5 CAMPress)",
           provenance="peer",
           inferred="h2o-decode's schedule (every 16, recent 32, 4 sinks) where kvpress runs every 512 tokens down "
                    "to 2048; each KV head evicts its own tokens (kvpress: one set for all); merges only at "
                    "decode-time runs (a prompt over the cap is cut by the prefill scorer, unmerged)"),
    Recipe("snapkv-decode", "snapkv", version=2, scorer_args={"window": 32, "kernel": 7},
           decode={"policy": "snapkv-decode", "every": 16, "recent": 32, "sinks": 4,
                   "args": {"window": 32, "kernel": 7}},
           source="https://arxiv.org/abs/2404.14469 (re-scored from the last 32 queries at every eviction)",
           provenance="abstract",
           inferred="SnapKV re-applied at every eviction as R-KV-style decode baselines describe it; no code read"),
    Recipe("growpage", "snapkv", version=2, scorer_args={"window": 1, "kernel": 1},
           decode={"policy": "growpage", "every": 16, "recent": 16, "sinks": 4},
           source="https://arxiv.org/abs/2609.03494", provenance="abstract",
           inferred="the method from a full-text summary; betas, working set, threshold, floor, max_share, "
                    "token-level eviction"),
    # steps as retention units over the caller's segments (kvcompile.segments; papers not found)
    Recipe("stepkv", "stepkv", scorer_args={"window": 32}, source="docs/methods_scorers.md#stepkv (paper not found)",
           provenance="description",
           inferred="step utility = attention mass of the last 32 queries on the step per token; steps in that order "
                    "as units, the current step first, the borderline step filled by the same attention"),
    Recipe("commitkv", "commitkv", scorer_args={"window": 32, "commit_tokens": 4, "epsilon": 0.01, "horizon": 8192},
           source="docs/methods_scorers.md#commitkv (paper not found)", provenance="description",
           inferred="a commit = the first 4 tokens of a segment (split by tool calls); deletion effect read as the "
                    "attention mass on the segment, before (that commit's queries) and after (the last 32 queries); "
                    "retire first when after <= 0.01 and after <= before; the first and current segments kept first"),
    Recipe("reco", "reco", scorer_args={"window": 32, "reward": "progress", "horizon": 512},
           source="docs/methods_scorers.md#reco (paper not found)", provenance="description",
           inferred="no process reward model: the step reward is the attention later steps' queries (of the last "
                    "512) pay the step, scaled by the best step, times StepKV's utility; reflection penalty off (an "
                    "option); early stop a generation option (generate(early_stop=EarlyStop(tokenizer)), off): "
                    "a row stops after a step that repeats an earlier one or holds an answer marker"),
    *(Recipe(f"kivi{bits}", None, format=f"kivi{bits}", precise_recent=128, version=2,
             source="https://arxiv.org/abs/2402.02750", provenance="abstract",
             inferred="KIVI's layout as secondary reports give it (its code was not read here): keys per "
                      "channel over one page of P tokens (KIVI: groups of 32 tokens), values per token in groups "
                      "of 32 channels, fp16 scale and minimum; the newest 128 tokens stay in the model's dtype, "
                      "and while decoding, every 128 tokens, those that left that window move to the format, so "
                      "128 to 256 stay in the dtype (KIVI quantizes every full group of 32: 128 to 160)")
      for bits in (2, 4)),
    Recipe("minikv", "snapkv", "pyramid", {"window": 32, "kernel": 7}, {"beta": 20.0, "window": 32},
           format="kivi2", source="https://arxiv.org/abs/2411.18077 (MiniKV)",
           provenance="abstract",
           inferred="from the abstract and the project page's overview: pyramid layer budgets over SnapKV's scores "
                    "stand for its 'rectified' selection policy (not described there), and the kept tokens are "
                    "stored as KIVI's 2-bit layout (keys per channel over a page, values per token); no token stays "
                    "in the model's dtype (a window there would be paid from the same byte budget, and refuse "
                    "budgets it alone exceeds)"),
    *FORMAT_RECIPES,
]
RECIPES: dict[str, Recipe] = {r.name: r for r in _BUILTIN}
