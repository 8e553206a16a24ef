"""Text a recipe names, as a tokenizer spells it: Transactional Attention's anchor patterns
(``methods.transactional``) and TaskPress's meta-query (``methods.taskpress``).

Anchors are strings (``password:``) but ``ta`` and ``ta-fast`` match token ids, a meta-query is read as token ids,
and methods import only torch: this module turns the text into id sequences for one tokenizer and fills them into
a recipe. The evaluation harness (``eval.sweep.run``) resolves every recipe it is given; a user of ``apply``
resolves once::

    recipe = kvcompile.recipes.anchors.resolve("ta-fast+snapkv", tok)
    cm = kvcompile.apply(model, budget=64, recipe=recipe)

Passing ``patterns`` is the allow-list: only those anchors sponsor (the paper's defence against injected anchors).
"""

from __future__ import annotations

import dataclasses
import functools

from ..methods import SCORERS
from . import Recipe, get_recipe

PATTERNS = ("password:", "passwd:", "key:", "api_key:", "token:", "token=", "secret:", "id:", "pin:", "code:")
DELIMITERS = ("\n", '"', "'")  # a value ends before the first token holding one of these characters (ta-fast)
TRANSACTIONAL = ("ta", "ta-fast")  # the scorers that match anchors
META_QUERY = ("taskpress",)  # the scorers that read a meta-query


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
    """``recipe`` with its text as ``tokenizer``'s ids: every ``ta`` / ``ta-fast`` among its scorers given
    ``patterns`` (and ``ta-fast`` the delimiters), every ``taskpress`` its meta-query (``instruction_ids``); ids given
    already are kept, and a recipe without such text is returned as it is. To compress while decoding, wrap the
    resolved recipe: ``compose("decoding", resolve("ta-fast+snapkv", tok))``."""
    recipe = get_recipe(recipe)
    args = _filled(recipe.scorer, recipe.scorer_args, _Spelling(tokenizer, patterns))
    return recipe if args == recipe.scorer_args else dataclasses.replace(recipe, scorer_args=args)


@dataclasses.dataclass
class _Spelling:
    """One tokenizer's ids for what a recipe names, each computed once (the delimiters read the whole vocabulary)."""

    tokenizer: object
    patterns: tuple

    @functools.cached_property
    def anchors(self) -> list[list[int]]:
        return anchor_ids(self.tokenizer, self.patterns)

    @functools.cached_property
    def delimiters(self) -> list[int]:
        return delimiter_ids(self.tokenizer)

    def text(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))


def _filled(scorer: str | None, args: dict, spelling: _Spelling) -> dict:
    """``args`` of ``scorer`` (and of every base it wraps) with their text spelled, where no ids were given."""
    args = dict(args)
    if "base" in args:
        args["base_args"] = _filled(args["base"], args.get("base_args", {}), spelling)
    if scorer in TRANSACTIONAL and args.get("anchors") is None:
        args["anchors"] = spelling.anchors
        if scorer == "ta-fast" and args.get("delimiters") is None:  # TA reads no delimiters
            args["delimiters"] = spelling.delimiters
    if scorer in META_QUERY and not args.get("instruction_ids"):
        text = args.get("meta_query", SCORERS[scorer].__dataclass_fields__["meta_query"].default)
        args["instruction_ids"] = spelling.text(text) if text else ()
    return args
