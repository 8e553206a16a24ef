"""The learned recipes (docs/methods_learned.md): their scorer reads weights trained here for SmolLM2-135M
(``kvcompile train kvzap``), shipped in ``kvcompile/weights`` and pinned by SHA-256, so new weights need a new
version; FastKVzip's gates, too large to ship, are trained by ``kvcompile train fastkvzip`` (``apply`` refuses
without them). Recipes with an ``adapter`` serve the model with LoRA weights trained here merged in
(``kvcompile.adapters``)."""

from __future__ import annotations

from .recipe import Recipe

_KVZAP_SHA = "d36f887f4f2dbe09049e2d9b6e69df9a413d627f9fb1c3b559d870cfa120574a"
_KVZAP = ("the surrogate reads each head's held value and key (its rotary-pair norms), not the hidden state (the "
          "cache holds none); a linear model per (layer, KV head) fitted by AdamW (kvpress: ridge per layer) on "
          "this library's KVzip scores (no instruction, one chunk; kvpress: KVzip+) of offline contexts; KVzip's "
          "4 sinks kept")
_KVZAP_HIDDEN_SHA = "9a85fd66554033fa087944b6521ded3f452d5ffcd6c0a0b52f53a8f7c71837b5"
_KVPOP_SHA = "e231e3e4f0632921e65c7961793b7076464a542ac8a18e7bd670f000793a10a5"
_KVPOP_DELAYED_SHA = "154b74f06728ee3e0eef4bfae542ec778f193cb6ea5d9067402dee42dd070683"
_SPARSE_FINETUNE_SHA = "053e56d64aa25ff7626a0d1d8d64fd9da638cff1997237d67502c25e51aba708"
_RESTOREKV_SHA = "18a4ca55fcc3ea5796cdc614165a1a74ce3701d5dc9ffc787b709642cbc20958"
_ABSTAIN_SHA = "879fae9961311a8626ae4d755841b03429a90a822dad1aee637ab1ad9bc6e0cc"
_H2O_ARGS = {"window": 8192, "block": 256, "heavy_ratio": 0.5}  # the h2o recipe's
_DMS_ARGS = {"base": "kvzap", "base_args": {"weights": "smollm2-135m", "sha256": _KVZAP_SHA}, "window": 128}

LEARNED = [
    Recipe("kvzap", "kvzap", "global-topk", {"weights": "smollm2-135m", "sha256": _KVZAP_SHA},
           trained_for="smollm2-135m",
           source="https://arxiv.org/abs/2601.07891 (kvpress KVzapPress)", provenance="peer", inferred=_KVZAP),
    Recipe("kvzap-hidden", "kvzap", "global-topk",
           {"weights": "smollm2-135m", "sha256": _KVZAP_HIDDEN_SHA, "inputs": "hidden"}, trained_for="smollm2-135m",
           source="https://arxiv.org/abs/2601.07891 (kvpress KVzapPress)", provenance="peer",
           inferred="the surrogate reads the attention input h_j, as kvpress, from one more dense forward of the "
           "source model (kvpress reads it from the forward it runs), so the context is read in one prefill; a ridge "
           "regression per (layer, KV head) on standardised h_j (kvpress: per layer, default penalty), penalty 1000 "
           "chosen on the last two training contexts; this library's KVzip scores (no instruction, one chunk; "
           "kvpress: KVzip+) of offline contexts; KVzip's 4 sinks kept"),
    Recipe("kvpop", "kvpop", "uniform", {"weights": "smollm2-135m", "sha256": _KVPOP_SHA}, trained_for="smollm2-135m",
           source="https://arxiv.org/abs/2607.05061 (KVpop: read through summaries, code not found)",
           provenance="abstract",
           inferred="the stateless scorer only (not the delayed, recurrent one); it reads what the cache holds of a "
           "token (KVzap's features: value and key norms), linear per (layer, KV head); its target, keep iff the "
           "queries 32 or more positions later pay the token top-quarter attention mass, learned with a "
           "cross-entropy weighted toward the keep boundary (the paper's loss form is not known); the newest 32 and "
           "4 sinks kept; every head evicted to the same budget"),
    Recipe("kvpop-delayed", "kvpop", "uniform", {"weights": "smollm2-135m", "sha256": _KVPOP_SHA},
           trained_for="smollm2-135m",
           decode={"policy": "kvpop-delayed", "every": 16, "recent": 32, "sinks": 4, "prompt": True,
                   "args": {"weights": "smollm2-135m", "sha256": _KVPOP_DELAYED_SHA}},
           source="https://arxiv.org/abs/2607.05061 (KVpop's delayed scorer: read through summaries, "
           "code not found)", provenance="abstract",
           inferred="the paper's recurrent (xLSTM-style) memory of the tokens that follow is one feature here: the "
           "attention the next 8 queries paid the token, beside kvpop's features, linear per (layer, KV head); the "
           "delay of 8 steps; the same target and loss as kvpop; the prompt, ranked by kvpop at prefill, kept while "
           "decoding; every 16 steps the generated tokens beyond the newest 32 and 4 sinks compete for the cap"),
    Recipe("fastkvzip", "fastkvzip", "global-topk", {"weights": "smollm2-135m"}, trained_for="smollm2-135m",
           source="https://arxiv.org/abs/2601.17668 (kvpress FastKVzipPress)", provenance="peer",
           inferred="the gate has kvpress's architecture (rank 16, 16 sinks, per layer) but is trained here, by "
           "squared error on the log of this library's KVzip scores (no instruction, one chunk) of offline contexts "
           "(the paper's loss and data are not published); too large to ship (13 MB), its weights are made by "
           "`kvcompile train fastkvzip`, seeded, and not pinned by digest"),
    Recipe("dms", "dms", "threshold", _DMS_ARGS, {"tau": -4.0}, trained_for="smollm2-135m",
           source="kvpress DMSPress over KVzap",
           provenance="peer", inferred=_KVZAP + "; prefill only (no decode-time FIFO); the budget caps what the "
           "threshold keeps (kvpress: the threshold alone decides); tau -4 from kvpress's README, not tuned here"),
    Recipe("dms-decode", "dms", "threshold", _DMS_ARGS, {"tau": -4.0}, trained_for="smollm2-135m",
           decode={"policy": "dms", "every": 16, "recent": 128, "args": {**_DMS_ARGS, "tau": -4.0}},
           source="DMS (https://arxiv.org/abs/2506.05345) as kvpress's DMSPress over KVzap, also "
           "while decoding", provenance="peer",
           inferred=_KVZAP + "; while decoding, the tokens that left the newest 128 are decided every 16 steps "
           "(DMS: each as it leaves), kept iff scored >= tau; the budget, counted over every token read, caps what "
           "is kept; tau -4 from kvpress's README, not tuned here"),
    Recipe("restorekv", "restorekv", "global-topk", {"weights": "smollm2-135m", "sha256": _RESTOREKV_SHA},
           trained_for="smollm2-135m", source="https://arxiv.org/abs/2608.01247 (kvpress RestoreKVPress)",
           provenance="peer",
           inferred="kvzip (no instruction, one chunk; kvpress: KVzip+) with 8 restore tokens: embeddings and a "
           "rank-8 LoRA (q, k, v, o; the paper's also the MLP) trained here by self-distillation on 12 offline "
           "contexts of 768 tokens, each at budgets 0.05, 0.1 and 0.25 (the continuation's KL to the full-cache "
           "model; the paper: self-study questions about long documents); 150 steps of 2; the restore pass runs "
           "before KVzip's reconstruction (kvpress: after scoring); the restore entries are kept first and charged "
           "to the budget"),
    Recipe("sparse-finetune-h2o", "h2o", "uniform", _H2O_ARGS, trained_for="smollm2-135m",
           adapter={"method": "sparse-finetune-h2o", "weights": "smollm2-135m", "sha256": _SPARSE_FINETUNE_SHA},
           source="awslabs/keys_values (fine-tuning under H2O)", provenance="peer",
           inferred="h2o, served by SmolLM2 with a rank-8 LoRA (q, k, v, o) fine-tuned here by self-distillation: "
           "on 16 offline contexts of 512 tokens, H2O at budget 0.25 compresses the first 448 and the adapted model "
           "matches the frozen full-cache model's next-token distribution over the last 64 (KL), reading the kept "
           "tokens (a dense masked pass, equal to the paged path); the kept set is the frozen model's while training "
           "(KeysAndValues trains while it evicts); 100 steps of 2 contexts"),
    Recipe("abstain-kvzip", "kvzip", "global-topk", {"n_sink": 4, "window": 8192}, trained_for="smollm2-135m",
           adapter={"method": "abstain", "weights": "smollm2-135m", "sha256": _ABSTAIN_SHA},
           source="compression-aware abstention (GroundLM @ EMNLP 2026; paper not read)",
           provenance="abstract",
           inferred="kvzip, served by SmolLM2 with a rank-8 LoRA (q, k, v, o) trained here on 48 offline needle "
           "samples (niah, pass key; 512 tokens) compressed query-agnostically by KVzip or SnapKV at 0.1 or 0.25: "
           "the target is the answer where each answer token is kept by at least 10% of the (layer, KV head) pairs, "
           "else the refusal 'I cannot find it in the context.'; next-token loss on the target while reading the "
           "kept context (a dense masked pass, equal to the paged path); 100 steps of 2 samples"),
]
