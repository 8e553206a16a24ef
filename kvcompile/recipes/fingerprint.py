"""Recipe fingerprints: a hash of what a recipe does, so its behaviour cannot change under the same version.

A fingerprint covers the recipe's behaviour fields (scorer, allocator, their arguments, the decode schedule) and
the code they run: its scorer, allocator and decode policy classes and, recursively, every function, class and
constant that code names inside ``kvcompile`` (so a fix in ``methods.base.merge_rankings`` moves the fingerprint
of every recipe that ranks through it). Code enters as its syntax tree without docstrings: comments, docstrings
and formatting leave a fingerprint alone, any other edit moves it.

``fingerprints.json`` holds each built-in recipe's version and fingerprint; ``tests/test_recipes.py`` fails with
the messages of ``check_fingerprints``. After a behaviour change, bump the recipe's version and re-record; after
a pure refactor (identical results), only re-record: ``python -m kvcompile.recipes.fingerprint --record``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import inspect
import json
import sys
import textwrap
import types
from pathlib import Path

from ..adapters import Adapter
from ..kernels.formats import FORMATS, PrunedCodec, get_format
from ..methods import ALLOCATORS, SCORERS
from ..methods.decoding import POLICIES
from ..methods.merging import ValueMerging
from ..methods.think import ThinK
from ..rerotation import rerotate
from . import RECIPES, Recipe
from .compose import WRAPPERS, parse

# built-in recipes, wrapper templates and the quantize-only recipe of every page format (names never collide)
RECORDED = {**RECIPES, **WRAPPERS, **{f"full+{name}": parse(f"full+{name}") for name in FORMATS}}

RECORD = Path(__file__).with_name("fingerprints.json")
RECORD_COMMAND = "python -m kvcompile.recipes.fingerprint --record"
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def behaviour(recipe: Recipe) -> dict:
    """The fields that decide what a recipe does: not its name, version, source or provenance."""
    fields = {"scorer": recipe.scorer, "allocator": recipe.allocator, "scorer_args": recipe.scorer_args,
              "allocator_args": recipe.allocator_args, "decode": recipe.decode}
    optional = {"prefill_chunk": recipe.prefill_chunk, "rerotate_keys": recipe.rerotate_keys,
                "format": recipe.format and repr(get_format(recipe.format)), "precise_recent": recipe.precise_recent,
                "precise_anchors": recipe.precise_anchors,
                "merge": recipe.merge, "adapter": recipe.adapter}
    return fields | {k: v for k, v in optional.items() if v}  # unset, they leave earlier fingerprints alone


def code_roots(recipe: Recipe) -> list[type]:
    """The classes a recipe runs: scorer, allocator, decode policy, and any scorer an argument names by its
    registered name (CriticalKV's ``base``), since that one is looked up at run time, not named in code."""
    roots = [ALLOCATORS[recipe.allocator]]
    roots += [SCORERS[recipe.scorer]] if recipe.scorer else []
    roots += [POLICIES[recipe.decode["policy"]]] if recipe.decode else []
    roots += [rerotate] if recipe.rerotate_keys else []
    roots += [ValueMerging] if recipe.merge else []
    roots += [Adapter] if recipe.adapter else []
    page_format = get_format(recipe.format) if recipe.format else None
    roots += [type(page_format.key), type(page_format.value)] if page_format else []
    roots += [ThinK] if page_format and isinstance(page_format.key, PrunedCodec) else []  # it picks the channels
    return roots + [SCORERS[s] for s in _strings([recipe.scorer_args, recipe.allocator_args, recipe.decode or {}])
                    if s in SCORERS]


def fingerprint(recipe: Recipe) -> str:
    """16 hex digits of sha256 over ``behaviour(recipe)`` and the code closure of ``code_roots(recipe)``."""
    payload = {"behaviour": behaviour(recipe), "code": code_closure(*code_roots(recipe))}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def code_closure(*roots) -> dict[str, str]:
    """{"module.qualname": normalised code} of ``roots`` (classes or functions) and of everything their code names
    that resolves, through the defining module's globals, module attributes and base classes, to a function,
    class or plain constant of ``kvcompile`` or of a root's own top-level package. Sorted by key."""
    packages = {"kvcompile"} | {r.__module__.split(".")[0] for r in roots}
    ours = lambda name: name.split(".")[0] in packages  # noqa: E731
    out, todo = {}, list(roots)
    while todo:
        obj = todo.pop()
        key = f"{obj.__module__}.{obj.__qualname__}"
        if key in out:
            continue
        out[key], names = _parsed(obj)
        for home, name, value in names:
            if (inspect.isfunction(value) or inspect.isclass(value)) and ours(value.__module__):
                todo.append(value)
            elif _is_constant(value) and ours(home):
                out[f"{home}.{name}"] = repr(value)
        if inspect.isclass(obj):
            todo += [base for base in obj.__mro__[1:] if ours(base.__module__)]
    return dict(sorted(out.items()))


@functools.cache  # code does not change within a process
def _parsed(obj) -> tuple[str, list]:
    """(normalised code, what it names) of one class or function."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    names = _references(tree, sys.modules[obj.__module__])
    return _normalised(tree), names


def _references(tree: ast.AST, module: types.ModuleType) -> list[tuple[str, str, object]]:
    """(home module, name, value) of every Name in ``tree`` found in ``module``'s globals and every
    ``module.attr`` taken from a module there (followed down chains such as ``a.b.c``)."""
    found = []

    def resolve(node):
        if isinstance(node, ast.Name) and node.id in vars(module):
            return module.__name__, node.id, vars(module)[node.id]
        if isinstance(node, ast.Attribute):
            owner = (resolve(node.value) or (None, None, None))[2]
            if isinstance(owner, types.ModuleType) and hasattr(owner, node.attr):
                return owner.__name__, node.attr, getattr(owner, node.attr)
        return None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and (hit := resolve(node)):
            found.append(hit)
    return found


def _normalised(tree: ast.AST) -> str:
    """The tree without docstrings, as text with no line numbers and no empty fields (which differ between
    Python versions: ``type_params``, ``kind``); a ``value`` field stays even when None."""
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:]

    def plain(x):
        if isinstance(x, ast.AST):
            fields = ast.iter_fields(x)
            return type(x).__name__, {k: plain(v) for k, v in fields if k == "value" or v is not None and v != []}
        return [plain(v) for v in x] if isinstance(x, list) else x

    return repr(plain(tree))


def _is_constant(value) -> bool:
    """A plain value whose repr is the same in every process (no object addresses)."""
    return isinstance(value, (bool, int, float, str)) or isinstance(value, tuple) and all(map(_is_constant, value))


def _strings(x) -> list[str]:
    """Every string value in nested dicts and lists."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [s for v in x for s in _strings(v)]
    return [x] if isinstance(x, str) else []


def check_fingerprints(recipes=None) -> list[str]:
    """One message per recipe (default: every built-in one) whose fingerprint the record does not hold at its
    version: its code or parameters changed at an unchanged version, or this version was never recorded."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    messages = []
    for r in RECORDED.values() if recipes is None else recipes:
        fp, seen = r.fingerprint, record.get(r.name)
        if seen is None or seen["version"] != r.version:
            was = "no version recorded" if seen is None else f"version {seen['version']} recorded"
            messages.append(f"recipe {r.name!r}@{r.version}: fingerprint {fp} not recorded at this version ({was}): "
                            f"record it with `{RECORD_COMMAND}`")
        elif seen["fingerprint"] != fp:
            messages.append(f"recipe {r.name!r}@{r.version}: its code or parameters changed (fingerprint {fp}, "
                            f"recorded {seen['fingerprint']}): bump its version if behaviour changed, or re-record "
                            f"with `{RECORD_COMMAND}` if this was a pure refactor with identical results")
    return messages


def record() -> None:
    """Write every built-in recipe's version and fingerprint to ``fingerprints.json``."""
    lines = [f"{json.dumps(n)}: {json.dumps({'version': r.version, 'fingerprint': r.fingerprint})}"
             for n, r in sorted(RECORDED.items())]
    RECORD.write_text("{\n " + ",\n ".join(lines) + "\n}\n")  # one line per recipe: diffs name the recipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompile.recipes.fingerprint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"write the current fingerprints to {RECORD.name}")
    args = parser.parse_args(argv)
    messages = check_fingerprints()
    print("\n".join(messages) or f"all {len(RECORDED)} recipe fingerprints match {RECORD.name}")
    if args.record:
        record()
        print(f"recorded {len(RECORDED)} recipes in {RECORD}")
        return 0
    return 1 if messages else 0


if __name__ == "__main__":
    sys.exit(main())
