"""What each command checks right after parsing, before it loads a model: a mistake on the command line costs the
user a second and one line on stderr (``UsageError``), not a model load and then a traceback.

``check`` runs the checks of one parsed command; ``lm_eval`` those of ``kvcompile lm-eval``, whose arguments
lm-eval parses. Unknown names come back with the closest known ones and where to list them all.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sqlite3
from pathlib import Path

from ..budget import Budget
from ..eval.store import Store, StoreError
from ..eval.sweep import parse_budget
from ..eval.synthetic import TASKS
from ..kernels.formats import FORMATS
from ..recipes import RECIPES, WRAPPERS, Recipe, get_recipe

LIST_RECIPES = "list them with: kvcompile recipes"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what load_model hands to the hub: not checked offline
# counts and sizes a command reads, by argparse name: what they may not go below
POSITIVE = ("n_samples", "length", "tokens", "max_new_tokens", "context", "scored", "windows", "rows", "contexts",
            "window", "hops", "workers", "cpus_per_worker", "steps", "batch", "per_length", "per_context", "rank",
            "continuation", "lr", "factor", "hidden_size", "intermediate_size", "heads", "kv_heads", "head_dim")
NOT_NEGATIVE = ("measure_separate", "greedy_tokens", "max_swaps", "hidden", "ridge", "held_out")


class UsageError(SystemExit):
    """A mistake on the command line, not a bug: ``main`` prints it as one line on stderr and exits with status 2,
    as argparse does on its own usage errors. A ``SystemExit`` so that an in-process caller gets that status too;
    ``str`` is the line, the command's name first once ``main`` has set ``command``."""

    def __init__(self, message: str, command: str = ""):
        super().__init__(2)
        self.message, self.command = message, command

    def __str__(self) -> str:
        return f"{self.command}: {self.message}" if self.command else self.message


def check(args) -> None:
    """Refuse what ``args`` (a parsed command other than ``lm-eval``) would fail on after loading its model."""
    given = {name: value for name, value in vars(args).items() if value is not None}
    for name in POSITIVE:
        if name in given and given[name] <= 0:
            raise UsageError(f"{_flag(name)} must be positive, got {given[name]}")
    for name in NOT_NEGATIVE:
        if name in given and given[name] < 0:
            raise UsageError(f"{_flag(name)} must be 0 or more, got {given[name]}")
    if "model" in given:
        model(given["model"])
    for name in ("out", "plot", "run_dir"):
        if given.get(name):
            writable(given[name], _flag(name))
    COMMANDS.get(args.analysis if args.command == "analyze" else args.command, lambda args: None)(args)


def _demo(args) -> None:
    if not 0 <= args.depth <= 1:
        raise UsageError(f"--depth is where the pass key sits, from 0 (start) to 1 (end); got {args.depth}")
    fits(recipe(args.recipe), budget(args.budget, "--budget"))


def _eval(args) -> None:
    _grid(args)
    if args.tasks != "all":
        tasks(args.tasks)
    if args.store:
        store(args.store, create=True)
    if args.executor == "ray" and args.measure_separate:
        raise UsageError("--measure-separate times one process; run it with --executor local")
    if args.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise UsageError("--executor ray needs Ray: pip install 'kvcompile[ray]'")


def _report(args) -> None:
    store(args.store, create=False)


def _fidelity(args) -> None:
    _grid(args)
    if args.store:
        store(args.store, create=True)


def _ceiling(args) -> None:
    counts(args.budgets, "--budgets")


def _needles(args) -> None:
    _grid(args)
    tasks(args.tasks)


def _train(args) -> None:
    recipe(args.recipe)
    if args.lengths:
        counts(args.lengths, "--lengths")
    if args.budget is not None:
        fraction(args.budget, "--budget")
    for text in _csv(args.budgets or ""):
        fraction(text, "--budgets")


def _grid(args) -> None:
    """A recipes x budgets grid: both lists given, every name and budget known."""
    for name in _listed(args.recipes, "--recipes"):
        recipe(name)
    for text in _listed(args.budgets, "--budgets"):
        budget(text, "--budgets")


def _doctor(args) -> None:
    if args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    for name in _listed(args.formats, "--formats"):
        if name != "fp32" and name not in FORMATS:
            raise _unknown("page format", name, ["fp32", *FORMATS], f"the formats: fp32, {', '.join(FORMATS)}")


COMMANDS = {"demo": _demo, "eval": _eval, "report": _report, "fidelity": _fidelity, "ceiling": _ceiling,
            "queryleak": _needles, "nominal": _needles, "diagnose": _needles, "gap": _grid, "train": _train,
            "doctor": _doctor}


def lm_eval(argv: list[str]) -> None:
    """``kvcompile lm-eval ARGS``: lm-eval checks its own arguments; these are kvcompile's: ``--store``, the
    ``kvc_*`` task names, and the kvcompile model's ``pretrained``, ``recipe`` and ``budget`` (``--model_args``)."""
    from ..eval import lm_eval_cli

    if {"-h", "--help"} & set(argv):
        return
    try:
        args, path = lm_eval_cli.split(argv)
        given = lm_eval_cli.pairs(args, "--model_args", "-a")
    except ValueError as e:
        raise UsageError(str(e)) from e
    if path:
        store(path, create=True)
    known = lm_eval_cli.task_names()
    for name in (t for word in lm_eval_cli.values(args, "--tasks", "-t") for t in _csv(word)):
        if name.startswith("kvc_") and name not in known:
            raise _unknown("task", name, known, "the kvcompile tasks: " + ", ".join(sorted(known)))
    if lm_eval_cli.values(args, "--model", "-M")[:1] == ["kvcompile"]:
        model(given.get("pretrained", "smollm2-135m"), "--model_args pretrained")
        fits(recipe(given.get("recipe", "full")), budget(given.get("budget", "1.0"), "--model_args budget"))


def model(name: str, option: str = "--model") -> None:
    """A name ``load_model`` takes: a short name it knows, a local model folder, or a hub id (``org/name``)."""
    from ..models import REGISTRY

    if name in REGISTRY or os.path.isdir(name) or HUB_ID.fullmatch(name):
        return
    if "/" in name or name.startswith((".", "~")):
        raise UsageError(f"{option} {name}: no such model folder")
    raise _unknown("model", name, REGISTRY, f"the known models: {', '.join(REGISTRY)}; or give a local model "
                   "folder or a hub id (org/name)")


def recipe(name: str) -> Recipe:
    """A recipe by name, or a composition ``[wrapper+...]recipe[+page format]`` (``recipes.compose``): each
    unknown part is named with the closest known ones, then the parts must fit together (``get_recipe``)."""
    parts = name.split("+")
    in_format = len(parts) > 1 and parts[-1] in FORMATS
    *wrappers, base = parts[:-1] if in_format else parts
    if base not in RECIPES:
        last = len(parts) > 1 and not in_format  # the last part of a composition: a misspelt page format, maybe
        raise _unknown("recipe or page format" if last else "recipe", base, [*RECIPES, *FORMATS] if last else RECIPES,
                       LIST_RECIPES, name)
    for part in wrappers:
        if part not in WRAPPERS and part not in RECIPES:  # a recipe there: get_recipe says only the last is wrapped
            raise _unknown("wrapper", part, WRAPPERS, LIST_RECIPES, name)
    try:
        return get_recipe(name)
    except ValueError as e:
        raise UsageError(f"recipe {name!r}: {e}") from e


def budget(text: str, option: str) -> Budget:
    """A budget as the commands read one (``sweep.parse_budget``): a fraction, tokens per KV head, or a size."""
    try:
        return Budget.parse(parse_budget(str(text)))
    except ValueError:
        raise UsageError(f"{option}: cannot read budget {text!r}: give a fraction of the context's KV bytes in (0, 1] "
                         "(0.25), tokens per KV head (512) or a size (64MiB)") from None


def fits(chosen: Recipe, within: Budget) -> None:
    """``apply``'s refusal of a recipe that keeps every token under a budget that would make it compress."""
    if chosen.scorer is None and chosen.format is None and not within.is_full:
        raise UsageError(f"recipe {chosen.name!r} keeps every token, so its budget can only be 1.0 (got {within}); "
                         f"pick a compressing recipe ({LIST_RECIPES})")


def tasks(text: str) -> None:
    """Synthetic task names (``eval.synthetic.TASKS``), comma-separated."""
    for name in _listed(text, "--tasks"):
        if name not in TASKS:
            raise _unknown("task", name, TASKS, "the tasks: " + ", ".join(TASKS))


def counts(text: str, option: str) -> None:
    """Comma-separated positive whole numbers."""
    for word in _listed(text, option):
        if not word.isdigit() or int(word) == 0:
            raise UsageError(f"{option}: {word!r} is not a positive whole number")


def fraction(value: float | str, option: str) -> None:
    """A budget that training reads as a fraction of the context: a number in (0, 1]."""
    try:
        inside = 0 < float(value) <= 1
    except ValueError:
        inside = False
    if not inside:
        raise UsageError(f"{option} must be a fraction in (0, 1], got {value}")


def store(path: str, *, create: bool) -> None:
    """A results store that opens: an existing file must be one (opening it migrates it, as the command would),
    a new one must be creatable (it is not created here); ``create=False``: reading one that must exist."""
    if Path(path).is_dir():
        raise UsageError(f"--store {path} is a folder; give a file name such as results.sqlite")
    if not Path(path).exists():
        if not create:
            raise UsageError(f"no results store at {path}")
        writable(path, "--store")
        return
    try:
        Store(path).close()
    except StoreError as e:
        raise UsageError(str(e)) from e
    except sqlite3.Error as e:
        raise UsageError(f"--store {path}: cannot open it ({e})") from e


def writable(path: str, option: str) -> None:
    """Refuse an output path whose folder cannot be made or written, before the run whose results it would hold."""
    folder = next(p for p in Path(path).absolute().parents if p.exists())
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot write in {folder}")


def _unknown(what: str, name: str, known, listing: str, within: str | None = None) -> UsageError:
    """``unknown recipe 'snapk'; did you mean 'snapkv'? list them with: kvcompile recipes``."""
    close = difflib.get_close_matches(name, list(known), n=3)
    guess = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    where = f" in {within!r}" if within and within != name else ""
    return UsageError(f"unknown {what} {name!r}{where}; {guess}{listing}")


def _listed(text: str, option: str) -> list[str]:
    items = _csv(text)
    if not items:
        raise UsageError(f"{option} is empty; give at least one, comma-separated")
    return items


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
