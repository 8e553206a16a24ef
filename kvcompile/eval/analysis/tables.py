"""What the grid analyses share: their samples (``samples``), means of per-sample rows by group, the Markdown
report, and the JSON + Markdown files."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from ..decoding import encode
from ..synthetic import get_task, make_sample


def check(tasks: list[str], n_samples: int) -> None:
    """Refuse, naming it, an unknown task or a sample count that is not a positive int, before any model runs."""
    for name in tasks:
        get_task(name)
    if not tasks:
        raise ValueError("no tasks given; name at least one, e.g. passkey")
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")


def samples(tokenizer, tasks: list[str], n_samples: int, length: int, seed: int, desc: str, progress: bool = True):
    """Each (task name, sample index, sample, context ids, question ids, answer length) of the needle tasks, with
    a progress bar."""
    bar = tqdm(total=len(tasks) * n_samples, disable=not progress, desc=desc)
    for name in tasks:
        task = get_task(name)
        for index in range(n_samples):
            sample = make_sample(task, tokenizer, length, seed=seed, index=index)
            context, question = (encode(tokenizer, t) for t in sample.prompt(tokenizer))
            yield name, index, sample, context, question, task.max_new_tokens
            bar.update(1)
    bar.close()


def means(rows: list[dict], by: tuple[str, ...], columns: tuple[str, ...]) -> list[dict]:
    """One dict per group of ``rows`` (keys ``by``, in first-seen order): ``n`` rows without an ``error``, the mean
    of each of ``columns`` over them (None when none has it), ``errors`` and the last error."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in by), []).append(row)
    out = []
    for key, group in groups.items():
        ok = [r for r in group if not r.get("error")]
        errors = [r["error"] for r in group if r.get("error")]
        mean = {c: (sum(v) / len(v) if (v := [r[c] for r in ok if r.get(c) is not None]) else None) for c in columns}
        out.append({**dict(zip(by, key)), "n": len(ok), **mean, "errors": len(errors),
                    "error": errors[-1] if errors else None})
    return out


def cell(value, spec: str) -> str:
    """A table cell: "-" for None, KiB for ``spec`` "kib", else ``format(value, spec)``."""
    if value is None:
        return "-"
    return f"{value / 1024:.0f}" if spec == "kib" else format(value, spec)


def markdown(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """Markdown lines: a header of the column names and one line per row, each value formatted by its spec."""
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(r.get(name), spec) for name, spec in columns) + " |" for r in rows]


def report(title: str, command: str, result: dict, explanation: str, rows: list[dict],
           columns: list[tuple[str, str]]) -> str:
    """The Markdown report: title, command, setting and timing, ``explanation``, the table, the full cache's score."""
    cfg, t = result["config"], result["timing"]
    full = [r for r in result["summary"] if r["recipe"].startswith("full@")]
    return "\n".join([
        f"# {title}", "", f"```bash\n{command}\n```", "",
        f"{cfg['n_samples']} samples per task at {cfg['length']} tokens, seed {cfg['seed']}; {t['total_s']:.0f} s in "
        f"all (2 shared CPU cores, under contention). {explanation}", "", *markdown(rows, columns), "",
        "Full cache: " + ", ".join(f"{r['task']} {cell(r['score'], '.2f')} ({cell(r['bytes_held'], 'kib')} KiB)"
                                   for r in full), ""])


def write(result: dict, out: str | Path, text: str, **extra) -> list[Path]:
    """``out``.json (``result`` and ``extra``) and ``out``.md (``text``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**extra, **result}, indent=1))
    out.with_suffix(".md").write_text(text)
    return [out.with_suffix(".json"), out.with_suffix(".md")]
