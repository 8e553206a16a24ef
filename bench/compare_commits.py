"""Decode speed of two commits of the library, measured in one run: does a refactor keep the speed it had?

The same bench script (``bench/decode.py`` of this checkout) runs against the library of ``--base`` (checked out
into a temporary git worktree) and of this checkout, alternately, ``--repeats`` times each (base, head, base,
head, ...), so drift of the machine hits both sides alike. Every variant's decode ms/token is the mean over the
repeats of each process's median round; the table gives both and head / base.

    python bench/compare_commits.py --base c239268 --repeats 2 -- --contexts 4096 --batches 4 \\
        --recipes snapkv --budgets 0.25 --steps 8 --rounds 3 --compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import ROOT, Results


def decode_rows(checkout: Path, args: list[str], out: Path) -> list[dict]:
    """``bench/decode.py args`` of this checkout over the library in ``checkout``: its rows."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), *args, "--out", str(out)], env=env,
                   check=True, cwd=checkout)
    return json.loads(out.with_suffix(".json").read_text())["rows"]


def worktree(commit: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit], check=True,
                   capture_output=True)
    return where


def compare(base: str, repeats: int, decode_args: list[str]) -> list[dict]:
    """One row per (context, batch, variant): the base's and the head's mean decode ms/token."""
    times: dict[tuple, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcompile-compare-") as tmp:
        sides = {"base": worktree(base, Path(tmp) / "base"), "head": ROOT}
        try:
            for i in range(repeats):
                for side, checkout in sides.items():
                    for row in decode_rows(checkout, decode_args, Path(tmp) / f"{side}{i}"):
                        for key in (k for k in row if k.endswith("_decode_ms")):
                            cell = (row["context"], row["batch"], key.removesuffix("_decode_ms"))
                            times.setdefault(cell, {"base": [], "head": []})[side].append(row[key])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(sides["base"])],
                           capture_output=True)
    return [{"context": c, "batch": b, "variant": v, "base_ms": statistics.mean(t["base"]),
             "head_ms": statistics.mean(t["head"]), "base_runs": t["base"], "head_runs": t["head"]}
            for (c, b, v), t in sorted(times.items())]


def table(rows: list[dict], base: str) -> str:
    lines = [f"| context | batch | variant | {base} ms | head ms | head / base |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['batch']} | {r['variant']} | {r['base_ms']:.1f} | {r['head_ms']:.1f} "
                     f"| {r['head_ms'] / r['base_ms']:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare this checkout with")
    p.add_argument("--repeats", type=int, default=2, help="processes per side, alternating")
    p.add_argument("--out", help="path stem of what is written (default bench/results/compare_commits/...)")
    p.add_argument("decode_args", nargs=argparse.REMAINDER, help="after --: bench/decode.py's arguments")
    args = p.parse_args()
    decode_args = [a for a in args.decode_args if a != "--"]
    out = Results("compare_commits", args.out)
    rows = compare(args.base, args.repeats, decode_args)
    out.json({"base": args.base, "decode_args": decode_args, "rows": rows})
    out.markdown(table(rows, args.base))
    print(table(rows, args.base))


if __name__ == "__main__":
    main()
