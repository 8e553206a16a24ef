"""Wrappers: recipe parts that change how another recipe selects (kvpress's wrapper presses), composed by name.

``"chunkkv+snapkv"`` is SnapKV's scorer inside ChunkKV; ``"decoding+knorm"`` compresses while generating by
re-scoring with KNorm; parts compose right to left (``"chunkkv+decoding+snapkv"``). ``compose`` takes the parts
and the wrapper's parameters. A wrapper is a ``Recipe`` template with a ``ROLE``: which part of the wrapped recipe
it takes over (its scorer, its allocator, its decode schedule, its prefill chunking). A composition's version is
the sum of its parts' versions less one per wrapper, so bumping any part moves it.
"""

from __future__ import annotations

import dataclasses

from ..kernels.formats import FORMATS, get_format
from . import RECIPES, Recipe, get_recipe

_PINS = "the base's pinned tokens rank first, their scores left out of the chunks' (kvpress adds max + 1 to them)"
_WRAPPERS = [  # (role, template)
    ("scorer", Recipe("chunkkv", "chunkkv", version=2,
                      scorer_args={"chunk": 20}, source="https://arxiv.org/abs/2502.00299",
                      provenance="peer",
                      inferred="the budget's last chunk is cut, where kvpress keeps it whole; " + _PINS)),
    ("scorer", Recipe("entropy-gated-chunkkv", "entropy-gated-chunkkv",
                      version=2, scorer_args={"chunk": 10, "low_entropy_chunk_length": 4},
                      source="kvpress 0.5.5 EntropyGatedChunkKVPress (no paper)", provenance="peer",
                      inferred=_PINS)),
    ("scorer", Recipe("chunk", "chunk", version=2,
                      scorer_args={"chunk": 1024}, source="kvpress 0.5.5 ChunkPress (FINCH-style)",
                      provenance="peer", inferred="chunk shares differ from kvpress's max(1, len (1 - ratio)) by "
                                                  "rounding; chunks by original position")),
    ("scorer", Recipe("composed", "composed", version=2,
                      scorer_args={"keep": 0.5}, source="kvpress 0.5.5 ComposedPress",
                      provenance="peer", inferred="the budget sets the final count; the first scorer's share is "
                                                  "``keep`` (kvpress: the product of the presses' ratios)")),
    ("scorer", Recipe("ta-fast", "ta-fast", version=2, scorer_args={"span": 16, "share": 0.25},
                      source="https://arxiv.org/abs/2604.11288 (Transactional Attention, TA-Fast)",
                      provenance="abstract",
                      inferred="from the abstract: anchors as token-id sequences (recipes.anchors.resolve), a value "
                               "of at most 16 tokens ending before a newline or quote, a 0.25 share of the budget "
                               "spent in context order; the scores are the merged ranking, nothing pinned")),
    ("scorer", Recipe("ta", "ta", version=2, scorer_args={"span": 16, "share": 0.25, "link": 0.02, "window": 8192},
                      source="https://arxiv.org/abs/2604.11288 (Transactional Attention, TA)", provenance="abstract",
                      inferred="from the abstract: as ta-fast, but a value ends where its own queries pay the anchor "
                               "less than 0.02 of their attention (the paper's rule is not in the abstract); reads "
                               "the last 8192 prompt queries")),
    ("allocator", Recipe("adakv", "snapkv", "adakv", version=2, allocator_args={"alpha_safeguard": 0.2},
                         source="https://arxiv.org/abs/2407.11550 (kvpress AdaKVPress around any scorer)",
                         provenance="peer")),
    ("allocator", Recipe("per-layer", "snapkv", "per-layer", version=2, source="kvpress 0.5.5 PerLayerCompressionPress",
                         provenance="peer", inferred="the ratios rescaled to spend the budget")),
    ("prefill", Recipe("block", "snapkv", version=2,
                       prefill_chunk=128, source="https://arxiv.org/abs/2504.15364 (block "
                       "prompt processing; kvpress BlockPress)", provenance="peer",
                       inferred="real chunked prefill, each 128-token block compressed with what was kept: kvpress "
                                "simulates it on the keys of one full prefill")),
    ("rerotate", Recipe("key-rerotation", "snapkv", version=2, rerotate_keys=True,
                        source="kvpress 0.5.5 KeyRerotationPress (FINCH's rerotate_keys)", provenance="peer",
                        inferred="kept keys moved right before the next query, not to 0..n-1 with the query moved to "
                                 "n: the same query-key distances, with one query position for ragged heads")),
    ("merge", Recipe("merging", "snapkv", version=2, merge={"similarity_threshold": 0.0, "merge_fraction": 1.0},
                     source="kvpress 0.5.5 MergingPress (after ToMe, arXiv 2210.09461, and D2O, arXiv 2406.13035)",
                     provenance="peer",
                     inferred="the epsilon of the merge weight (1e-6); the fraction's quantile over every evicted "
                              "similarity of a head; merges into whatever the allocator keeps, ragged or not")),
    ("decode", Recipe("decoding", "snapkv", version=2, decode={"policy": "scorer", "every": 512, "recent": 0,
                                                    "args": {"buffer": 256}},
                      source="kvpress 0.5.5 DecodingPress", provenance="peer",
                      inferred="the cap is a bound (kvpress oscillates between target and target + interval), so "
                               "the first run comes after the first decode step, then every 512; the wrapped scorer "
                               "also compresses a prompt over the cap")),
    ("decode", Recipe("compression-ratio-decoding", "snapkv", version=2,
                      decode={"policy": "scorer", "every": 512, "recent": 0,
                                                                      "args": {"buffer": 256}},
                      source="kvpress 0.5.5 CompressionRatioDecodingPress (a fraction budget: the cap is that "
                             "fraction of the tokens seen)", provenance="peer",
                      inferred="the same schedule as decoding: here the budget's kind, not the wrapper, makes the "
                               "cap a fraction of the tokens seen")),
]
WRAPPERS: dict[str, Recipe] = {r.name: r for _, r in _WRAPPERS}
ROLE: dict[str, str] = {r.name: role for role, r in _WRAPPERS}
_STRENGTH = ("official-code", "paper", "peer", "abstract", "description", "control", "custom")  # strongest first


def compose(*parts: str | Recipe, **args) -> Recipe:
    """The recipe ``parts[-1]`` (a name or ``Recipe``) wrapped by the wrappers named before it, innermost last;
    ``args`` update the outermost wrapper's parameters (``compose("per-layer", "snapkv",
    compression_ratios=[...])``)."""
    *wrappers, base = parts
    if not wrappers:
        raise ValueError("compose needs at least one wrapper before the recipe, e.g. compose('chunkkv', 'snapkv')")
    recipe = get_recipe(base)
    for i, name in enumerate(reversed(wrappers)):
        recipe = _wrap(name, recipe, args if i == len(wrappers) - 1 else {})
    return recipe


def prefill_decoding(prefill: str | Recipe, decoding: str | Recipe) -> Recipe:
    """kvpress's PrefillDecodingPress: ``prefill``'s scorer and allocator for the prompt, ``decoding``'s schedule
    while generating (``prefill_decoding("snapkv", "decoding+knorm")``)."""
    first, then = get_recipe(prefill), get_recipe(decoding)
    if then.decode is None:
        raise ValueError(f"recipe {then.name!r} does not compress while decoding; wrap it: 'decoding+{then.name}'")
    return _joined(first, then, name=f"prefill-decoding({first.name},{then.name})", decode=then.decode,
                   source=f"kvpress 0.5.5 PrefillDecodingPress; {first.source}; {then.source}")


def parse(name: str) -> Recipe:
    """``"chunkkv+snapkv"`` -> ``compose("chunkkv", "snapkv")``; a page format named last stores what the
    recipe keeps in it: ``"snapkv+int4"`` -> ``in_format("snapkv", "int4")``."""
    *parts, last = name.split("+")
    if last in FORMATS:
        return in_format("+".join(parts), last)
    return compose(*parts, last)


def in_format(recipe: str | Recipe, page_format: str) -> Recipe:
    """``recipe`` storing what it keeps in ``page_format`` (``kernels.formats``), the budget still bytes of the
    model's dtype: ``in_format("snapkv", "int4")`` at ``budget=0.25`` keeps as many int4 tokens as fit a quarter
    of the context's bytes. ``in_format("full", ...)`` quantizes without evicting."""
    base, fmt = get_recipe(recipe), get_format(page_format)
    if base.format is not None:
        raise ValueError(f"recipe {base.name!r} already stores {base.format} pages")
    return dataclasses.replace(base, name=f"{base.name}+{page_format}", format=page_format,
                               version=base.version + fmt.version - 1)


def _wrap(name: str, base: Recipe, args: dict) -> Recipe:
    if name not in WRAPPERS:
        hint = " (a recipe, not a wrapper: only the last part is wrapped)" if name in RECIPES else ""
        raise ValueError(f"unknown wrapper {name!r}{hint}; wrappers: {', '.join(sorted(WRAPPERS))}")
    if base.scorer is None:
        raise ValueError(f"wrapper {name!r} needs a recipe that evicts, got {base.name!r}")
    w, role = WRAPPERS[name], ROLE[name]
    fields = {}
    if role == "scorer":
        fields = {"scorer": w.scorer,
                  "scorer_args": {**w.scorer_args, **args, "base": base.scorer, "base_args": base.scorer_args}}
    elif role == "allocator":
        fields = {"allocator": w.allocator, "allocator_args": {**w.allocator_args, **args}}
    elif role == "prefill":
        fields = {"prefill_chunk": args.get("block_size", w.prefill_chunk)}
    elif role == "rerotate":
        fields = {"rerotate_keys": True}
    elif role == "merge":
        fields = {"merge": {**w.merge, **args}}
    elif role == "decode":
        policy_args = {**w.decode["args"], "scorer": base.scorer, "scorer_args": base.scorer_args}
        fields = {"decode": {**w.decode, **args, "args": policy_args}}
    return _joined(base, w, name=f"{name}+{base.name}", source=f"{w.source}; {base.source}", **fields)


def _joined(base: Recipe, other: Recipe, **fields) -> Recipe:
    """``base`` with ``fields`` replaced, versioned, evidenced and inferred as the two recipes together."""
    strength = max(_STRENGTH.index(other.provenance), _STRENGTH.index(base.provenance))
    return dataclasses.replace(
        base, version=other.version + base.version - 1, provenance=_STRENGTH[strength],
        inferred="; ".join(x for x in (other.inferred, base.inferred) if x), **fields,
    )
