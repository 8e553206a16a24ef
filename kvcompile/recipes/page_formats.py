"""Built-in recipes that are page formats of their own (``kernels.formats``): ThinK's pruned keys. Listed after
the other built-ins (``builtin``)."""

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
]
