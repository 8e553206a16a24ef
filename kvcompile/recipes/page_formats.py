"""Built-in recipes that are page formats of their own (``kernels.formats``): ThinK's pruned keys, Minima-KV's
TQ3 pages beside anchor pages. Listed after the other built-ins (``builtin``)."""

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
           source="https://arxiv.org/abs/2608.23834 (Minima-KV; METHODS.md section 13)", provenance="abstract",
           inferred="the abstract and a third-party reproduction script: its defaults (anchor every 4th page, 2 "
                    "recent pages of 16 = the newest 32 tokens) and its TQ3 (Hadamard rotation, 3-bit codes, one "
                    "grid per page and head; keys: an fp16 norm per token and a renormalised direction); the "
                    "anchor and recent pages stay in the model's dtype, not FP8 (this cache holds one format pool "
                    "beside the model-dtype pool); anchors are pages of the cache's page size in positions; while "
                    "decoding, every 32 tokens, those that left the window and are no anchors move to TQ3"),
]
