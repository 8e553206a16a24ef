"""lm-eval's command line and task manager with the kvcompile model registered and the ``kvc_*`` tasks included;
``--store PATH`` also writes every sample to a results store (``lm_eval_store``)."""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

from . import harness  # registers the "kvcompile" lm-eval model

TASKS_DIR = Path(__file__).parent / "tasks"


def task_manager(**metadata):
    """An lm-eval ``TaskManager`` that knows the kvcompile tasks (``kvc_*``); ``metadata`` reaches their loaders
    (``tokenizer``, ``length``, ``num_samples``, ``seed``)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), metadata=metadata)


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's command line with the kvcompile model registered and the kvcompile tasks included."""
    from lm_eval.__main__ import cli_evaluate

    try:
        args, store = split(list(sys.argv[1:] if argv is None else argv))
    except ValueError as e:  # ``kvcompile lm-eval`` refuses it before it calls here: this is ``-m kvcompile.eval``
        print(f"kvcompile.eval: {e}", file=sys.stderr)
        return 2
    if args and not {"-h", "--help", "--include_path"} & set(args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    with _storing(store) if store else nullcontext():
        cli_evaluate()
    return 0


def split(args: list[str]) -> tuple[list[str], str | None]:
    """lm-eval's arguments and the ``--store PATH`` (or ``--store=PATH``) taken out of them; ValueError for a
    ``--store`` without a path, or with a model other than kvcompile's."""
    store = None
    for i, a in enumerate(args):
        if a == "--store":
            if i + 1 == len(args):
                raise ValueError("--store needs a path: --store results.sqlite")
            args, store = args[:i] + args[i + 2 :], args[i + 1]
            break
        if a.startswith("--store="):
            args, store = args[:i] + args[i + 1 :], a.split("=", 1)[1]
            break
    model = values(args, "--model", "-M")[:1]
    if store and model != ["kvcompile"]:
        raise ValueError(f"--store writes the kvcompile model's results; got --model {model[0] if model else None}")
    return args, store


def values(args: list[str], *names: str) -> list[str]:
    """The words given to the option ``names`` (its spellings): those after it up to the next option, and the
    value of ``NAME=VALUE``, in order."""
    found, taking = [], False
    for a in args:
        if a.startswith("-"):
            taking = a in names
            found += [a.split("=", 1)[1] for name in names if a.startswith(name + "=")]
        elif taking:
            found.append(a)
    return found


def pairs(args: list[str], *names: str) -> dict[str, str]:
    """The ``key=value`` pairs given to the option ``names`` (``--model_args``), as text: words of
    ``key=value,key=value``, or a JSON object."""
    found = {}
    for word in values(args, *names):
        if word.lstrip().startswith("{"):
            try:
                found.update({k: str(v) for k, v in json.loads(word).items()})
            except json.JSONDecodeError as e:
                raise ValueError(f"{names[0]}: {word} is not a JSON object ({e})") from e
        else:
            found.update(item.split("=", 1) for item in word.split(",") if "=" in item)
    return found


def task_names() -> set[str]:
    """The kvcompile tasks' names and tags (``kvc_*``), as their YAML files declare them."""
    names = set()
    for path in TASKS_DIR.glob("*.yaml"):
        names.update(re.findall(r"^(?:task:|\s*-)\s*(kvc_\w+)\s*$", path.read_text(), re.MULTILINE))
    return names


@contextmanager
def _storing(path: str):
    """For one run, ``lm_eval.simple_evaluate`` (which lm-eval's command line looks up as it runs) builds the
    kvcompile model itself, asks for per-sample results, gathers every rank's prefills and writes the rows to
    ``path`` on rank 0. The command line builds its model inside ``simple_evaluate`` and never hands it out, and the
    rows need that model's accounting; so this wrapper, not a copy of lm-eval's command line."""
    import lm_eval
    from lm_eval import evaluator

    from . import lm_eval_store
    from .store import Store

    def evaluate_and_store(model, model_args=None, *, batch_size=None, max_batch_size=None, device=None,
                           log_samples=False, **kwargs):
        extra = {"batch_size": batch_size, "max_batch_size": max_batch_size, "device": device}
        if isinstance(model_args, dict):
            lm = harness.KVCompileLM.create_from_arg_obj(model_args, extra)
        else:
            lm = harness.KVCompileLM.create_from_arg_string(model_args or "", extra)
        results = evaluator.simple_evaluate(model=lm, model_args=model_args, batch_size=batch_size,
                                            max_batch_size=max_batch_size, device=device, log_samples=True, **kwargs)
        requests = lm.gather_object(lm.requests)  # every rank calls it; rank 0 gets them all
        if results is not None:
            results["config"]["model"] = model
            rows = lm_eval_store.rows(results, lm, [r for rank in requests for r in rank])
            with Store(path) as store:
                written = store.add(rows)
            print(f"results store {path}: {written} of {len(rows)} sample rows written (the rest were stored already)")
            if not log_samples:
                results.pop("samples")
        return results

    had = "simple_evaluate" in vars(lm_eval)
    before = vars(lm_eval).get("simple_evaluate")
    lm_eval.simple_evaluate = evaluate_and_store
    try:
        yield
    finally:
        if had:
            lm_eval.simple_evaluate = before
        else:
            del lm_eval.simple_evaluate
