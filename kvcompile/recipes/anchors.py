"""Transactional Attention's anchor patterns as a tokenizer spells them (``methods.transactional``).

Anchors are strings (``password:``) but ``ta`` and ``ta-fast`` match token ids, and methods import only torch:
this module turns the patterns into id sequences for one tokenizer and fills them into a recipe. The evaluation harness
(``eval.sweep.run``) resolves every recipe it is given; a user of ``apply`` resolves once::

    recipe = kvcompile.recipes.anchors.resolve("ta-fast+snapkv", tok)
    cm = kvcompile.apply(model, budget=64, recipe=recipe)

Passing ``patterns`` is the allow-list: only those anchors sponsor (the paper's defence against injected anchors).
"""

from __future__ import annotations

import dataclasses

from . import Recipe, get_recipe

PATTERNS = ("password:", "passwd:", "key:", "api_key:", "token:", "token=", "secret:", "id:", "pin:", "code:")
DELIMITERS = ("\n", '"', "'")  # a value ends before the first token holding one of these characters (ta-fast)
TRANSACTIONAL = ("ta", "ta-fast")  # the scorers that match anchors


def anchor_ids(tokenizer, patterns=PATTERNS) -> list[list[int]]:
    """Every pattern's id sequences: as written, capitalised, and after a space (BPE spells a word differently
    there), without special tokens; duplicates dropped."""
    if isinstance(patterns, str) or not patterns or not all(isinstance(p, str) and p.strip() for p in patterns):
        raise ValueError(f"anchor patterns must be a non-empty list of non-blank strings, got {patterns!r}")
    spelled = {}
    for pattern in patterns:
        for text in (pattern, pattern.capitalize(), " " + pattern, " " + pattern.capitalize()):
            spelled.setdefault(tuple(tokenizer.encode(text, add_special_tokens=False)), None)
    return [list(seq) for seq in spelled if seq]


def delimiter_ids(tokenizer, delimiters=DELIMITERS) -> list[int]:
    """The ids of every vocabulary token whose text holds a delimiter character."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(texts) if any(d in text for d in delimiters)]


def resolve(recipe: str | Recipe, tokenizer, patterns=PATTERNS) -> Recipe:
    """``recipe`` with every ``ta`` / ``ta-fast`` among its scorers given ``patterns`` (and ``ta-fast`` the
    delimiters) as ``tokenizer``'s ids (anchors given already are kept); any other recipe is returned as it is.
    To compress while decoding, wrap the resolved recipe: ``compose("decoding", resolve("ta-fast+snapkv", tok))``."""
    recipe = get_recipe(recipe)
    if not _needs(recipe.scorer, recipe.scorer_args):
        return recipe
    filled = {"anchors": anchor_ids(tokenizer, patterns)}
    if _needs(recipe.scorer, recipe.scorer_args, ("ta-fast",)):
        filled["delimiters"] = delimiter_ids(tokenizer)
    return dataclasses.replace(recipe, scorer_args=_filled(recipe.scorer, recipe.scorer_args, filled))


def _needs(scorer: str | None, args: dict, kinds=TRANSACTIONAL) -> bool:
    """Whether one of ``kinds`` without anchors is ``scorer`` or any base it wraps."""
    if scorer in kinds and args.get("anchors") is None:
        return True
    return "base" in args and _needs(args["base"], args.get("base_args", {}), kinds)


def _filled(scorer: str, args: dict, filled: dict) -> dict:
    args = dict(args)
    if "base" in args:
        args["base_args"] = _filled(args["base"], args.get("base_args", {}), filled)
    if scorer in TRANSACTIONAL and args.get("anchors") is None:
        args.update(filled if scorer == "ta-fast" else {"anchors": filled["anchors"]})  # TA reads no delimiters
    return args
