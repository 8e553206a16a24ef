"""lm-eval's command line and task manager with the kvcompile model registered and the ``kvc_*`` tasks included."""

from __future__ import annotations

import sys
from pathlib import Path

from . import harness  # noqa: F401  (registers the "kvcompile" lm-eval model)

TASKS_DIR = Path(__file__).parent / "tasks"


def task_manager(**metadata):
    """An lm-eval ``TaskManager`` that knows the kvcompile tasks (``kvc_*``); ``metadata`` reaches their loaders
    (``tokenizer``, ``length``, ``num_samples``, ``seed``)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), metadata=metadata)


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's command line with the kvcompile model registered and the kvcompile tasks included."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not {"-h", "--help", "--include_path"} & set(args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()
    return 0
