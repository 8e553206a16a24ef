"""Built-in recipes that are page formats of their own (``kernels.formats``): ThinK's pruned keys, Minima-KV's
TQ3 pages beside anchor pages, SPECTRA's and SAKI's rows in a calibrated basis, AnchorKV's rows against anchors; and
TaskPress, which ranks by what a quantized page stores. Listed after the other
built-ins (``builtin``)."""

from __future__ import annotations

from .recipe import Recipe

FORMAT_RECIPES = [
    Recipe("think", None, format="think", precise_recent=32,
           source="https://arxiv.org/abs/2407.21018 (kvpress 0.5.5 ThinKPress)", provenance="peer",
           inferred="key_channel_compression_ratio 0.5 (kvpress's default 0.0 drops nothing); kvpress zeroes the "
                    "channels, here the keys are stored without them (fp32 pages listing the kept channels); "
                    "decoding (kvpress prunes the prompt only): the newest 32 tokens keep every channel and, every "
                    "32 tokens, those that left that window are stored with the channels their head chose at the "
                    "last compression; a later compression (a chunked prefill) chooses again, and what either "
                    "choice dropped stays dropped"),
    Recipe("minima-kv", None, format="tq3", precise_recent=32, precise_anchors=4,
           source="https://arxiv.org/abs/2608.23834 (Minima-KV)", provenance="abstract",
           inferred="the abstract and a third-party reproduction script: its defaults (anchor every 4th page, 2 "
                    "recent pages of 16 = the newest 32 tokens) and its TQ3 (Hadamard rotation, 3-bit codes, one "
                    "grid per page and head; keys: an fp16 norm per token and a renormalised direction); the "
                    "anchor and recent pages stay in the model's dtype, not FP8 (this cache holds one format pool "
                    "beside the model-dtype pool); anchors are pages of the cache's page size in positions; while "
                    "decoding, every 32 tokens, those that left the window and are no anchors move to TQ3"),
    Recipe("spectra", None, format="spectra4",
           source="https://arxiv.org/abs/2608.07915 (SPECTRA)", provenance="abstract",
           inferred="from a detailed full-text summary, no code: the basis from each head's pre-RoPE key and value "
                    "second moments (equal to the paper's W_K SVD over hidden-state moments at full rank), measured "
                    "on 4 x 256 tokens the model samples itself from its BOS token (apply holds no tokenizer); "
                    "groups of 32 latent channels share a width (the integer optimum of the water-filling objective, "
                    "mean 4 bits: int4's bytes); a 0-bit group keeps the token's mean; keys stored before RoPE and "
                    "rotated when read; no eviction ('snapkv+spectra4' evicts too)"),
    Recipe("saki", None, format="saki4",
           source="https://arxiv.org/abs/2608.03228 (SAKI v1)", provenance="abstract",
           inferred="from a detailed reading of v1, no code: SAKI's score-preserving factorisation used as a key "
                    "format at full rank, codes c = B_k^T (k - mu) stored at a mean of 4 bits per channel (groups of "
                    "32 share a width, given by the score error lambda^2 4^-b) and read back as mu + B_q c before "
                    "RoPE; values as int4 (the paper is keys only); moments as 'spectra' calibrates them; v2's "
                    "noise correction not implemented; no eviction"),
    Recipe("anchorkv", None, format="anchor2",
           source="https://arxiv.org/abs/2608.02901 (AnchorKV)", provenance="abstract",
           inferred="from a third-party transcription of the method section, no code: its constants (32 trailing "
                    "anchors, k = max(32, S / 128), 70% by SnapKV with an average pool of 7, the rest random with "
                    "seed 42, 2-bit Lloyd-Max residuals after a randomized Hadamard transform) as transcribed; the "
                    "residual scale is the RMS (the source says per-token absmax); anchors stored in fp32 (the "
                    "model's dtype here; the paper's BF16); the residual slots split equally between layers and "
                    "between keys and values; the observation queries are the last 32; no eviction, decode tokens "
                    "appended exactly"),
    Recipe("taskpress", "taskpress", scorer_args={"window": 8192, "n_sink": 4, "bits": 4, "group": 32},
           source="docs/methods_scorers.md#taskpress (no paper, code or summary found)", provenance="description",
           inferred="all of it: the meta-query 'Answer the question about the text above.' read once after the "
                    "context (its ids for a tokenizer: recipes.anchors.resolve), KVzip's probe of its attention "
                    "(max over its tokens and the GQA group) times each value's int4 quantization step (groups of "
                    "32), 4 sinks, a uniform budget per head; pair with '+int4' to store what the scale describes"),
]
