"""bench/ replays: every result records what made it and where (``bench/record.py``), every script writes through
that helper, and bench/README.md names the command behind every table of docs/results.md. No benchmark runs here:
the helper writes a dummy result, the rest reads the sources."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS_DOC = ROOT / "docs" / "results.md"
README = BENCH / "README.md"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "record.py")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?\s*\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
COMMAND = re.compile(r"`[^`]*(?:python bench/\w+\.py|kvcompile \w)[^`]*`")


@pytest.fixture
def record(monkeypatch):
    """bench/record.py, loaded from its path (bench/ is not a package), with a bandwidth that costs nothing."""
    spec = importlib.util.spec_from_file_location("bench_record", BENCH / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "bandwidth", lambda: {"read": 12.5, "copy": 20.0})
    module.machine.cache_clear()
    yield module
    module.machine.cache_clear()


def test_a_result_records_command_commit_versions_and_machine(record, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [str(BENCH / "dummy.py"), "--rounds", "2"])
    for name in [k for k in os.environ if k in record.ENV or k.startswith("KVCOMPILE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = record.Results("dummy", tmp_path / "dummy")
    out.json({"rows": [1, 2]})
    md = out.markdown("# A table\n\n| a |\n|---|\n| 1 |\n")
    saved = json.loads((tmp_path / "dummy.record.json").read_text())

    assert saved["command"] == "OMP_NUM_THREADS=1 python bench/dummy.py --rounds 2"
    assert saved["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", saved["commit"])
    assert saved["dirty"] in (True, False, None)
    assert {"python", "torch", "transformers", "kvcompile", "numpy", "triton"} <= set(saved["versions"])
    assert saved["versions"]["torch"] and saved["versions"]["python"]
    machine = saved["machine"]
    assert machine["cpu"] and isinstance(machine["flags"], list) and machine["cores"] >= 1
    assert set(machine["flags"]) <= set(record.FLAGS)
    assert machine["bandwidth_gbs"] == {"read": 12.5, "copy": 20.0}
    assert saved["threads"] >= 1 and saved["gpu"] is None  # this process never used CUDA
    assert saved["environment"] == {"OMP_NUM_THREADS": "1"} and saved["started"] and saved["written"]
    assert saved["files"] == ["dummy.json", "dummy.md"]
    assert json.loads((tmp_path / "dummy.json").read_text()) == {"rows": [1, 2]}

    lines = md.read_text().splitlines()
    assert lines[0] == "# A table" and lines[2].startswith("> Made by `OMP_NUM_THREADS=1 python bench/dummy.py")
    assert machine["cpu"] in lines[2] and "12.5 GB/s" in lines[2] and "dummy.record.json" in lines[2]
    out.markdown("# A table\n\n| a |\n|---|\n| 2 |\n")  # a rewrite (a resumed run) keeps one header
    assert md.read_text().count("> Made by") == 1 and md.read_text().rstrip().endswith("| 2 |")


def test_files_of_other_writers_and_folders_are_recorded(record, tmp_path):
    """``adopt`` names files a library writer made at the stem (and heads its Markdown); ``path`` a file in a
    folder named by the stem, as ``compare_kvpress.py save`` keeps its grid."""
    out = record.Results("dummy", tmp_path / "sweep")
    (tmp_path / "sweep.csv").write_text("a\n")
    (tmp_path / "sweep.md").write_text("plain table\n")
    out.adopt([tmp_path / "sweep.csv", tmp_path / "sweep.md"])
    assert (tmp_path / "sweep.md").read_text().startswith("> Made by `")
    grid = record.Results("dummy", tmp_path / "grid")
    grid.path("/raw.json.gz").write_bytes(b"")
    assert json.loads((tmp_path / "sweep.record.json").read_text())["files"] == ["sweep.csv", "sweep.md"]
    assert json.loads((tmp_path / "grid.record.json").read_text())["files"] == ["grid/raw.json.gz"]


def test_the_default_stem_is_the_scripts_folder(record):
    assert record.default_stem("decode") == BENCH / "results" / "decode" / "decode"
    assert record.default_stem("floor", "grid") == BENCH / "results" / "floor" / "grid"


def test_bandwidth_is_measured():
    """The real measurement (small here): GB/s of a sum and of a copy, both positive."""
    spec = importlib.util.spec_from_file_location("bench_record_real", BENCH / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bw = module.bandwidth(mib=8, repeats=2)
    assert set(bw) == {"read", "copy"} and all(v > 0 for v in bw.values())


def _calls(tree: ast.AST, name: str):
    """Calls of ``name`` as a plain name or as an attribute (``x.name(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                yield node


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_script_writes_through_the_helper(script):
    """The results folder is known to record.py alone: a script imports it and makes a ``Results``, and neither
    names bench/results in code, saves a figure, dumps JSON into a file nor opens a file for writing itself."""
    tree = ast.parse(script.read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "record"]
    imports += [n for n in ast.walk(tree) if isinstance(n, ast.Import) and any(a.name == "record" for a in n.names)]
    problems = [] if imports else ["does not import record"]
    if not any(_calls(tree, "Results")):
        problems.append("makes no Results")
    problems += [f"line {c.lineno}: savefig" for c in _calls(tree, "savefig")]
    problems += [f"line {c.lineno}: json.dump" for c in _calls(tree, "dump") if ast.unparse(c.func) == "json.dump"]
    for c in _calls(tree, "open"):
        mode = c.args[1] if len(c.args) > 1 else next((k.value for k in c.keywords if k.arg == "mode"), None)
        if isinstance(c.func, ast.Name) and isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax"):
            problems.append(f"line {c.lineno}: open(..., {mode.value!r})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "RESULTS":
            problems.append(f"line {node.lineno}: a RESULTS path of its own")
        if isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant) and node.right.value == "results":
            problems.append(f"line {node.lineno}: a results folder of its own")
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "Path" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("bench/results"):
            problems.append(f"line {node.lineno}: Path({node.args[0].value!r})")
    assert not problems, f"{script.name}: " + "; ".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without links and tags, lowercase, only letters, digits, "_", "-"
    and spaces kept, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield number, line


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in _prose(path):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            seen[base] = seen.get(base, -1) + 1
    return {base if n == 0 else f"{base}-{n}" for base, count in seen.items() for n in range(count + 1)}


def _table_sections(path: Path) -> list[str]:
    """Anchors of the ``##`` / ``###`` sections that hold a Markdown table before the next heading."""
    found, current = [], None
    for _, line in _prose(path):
        m = re.match(r"^(##|###) (.*)", line)
        if m:
            current = slug(m.group(2))
        elif current and re.match(r"^\s*\|(\s*:?-+:?\s*\|)+\s*$", line) and current not in found:
            found.append(current)
    return found


def _readme_rows() -> dict[str, str]:
    """{docs/results.md anchor: command cell} of the rows of bench/README.md's command table."""
    rows = {}
    for _, line in _prose(README):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        m = re.search(r"\(\.\./docs/results\.md#([\w-]+)\)", cells[0]) if len(cells) >= 3 else None
        if m:
            rows[m.group(1)] = cells[1]
    return rows


def test_every_results_table_has_its_command_in_bench_readme():
    """Convention: bench/README.md has one table row per section of docs/results.md that holds a table; its first
    cell links the section (a link to its heading's anchor in ../docs/results.md), its second holds the command in
    a code span (``python bench/<script>.py ...`` or ``kvcompile <command> ...``)."""
    rows = _readme_rows()
    sections = _table_sections(RESULTS_DOC)
    assert sections, "no table found in docs/results.md"
    missing = [s for s in sections if s not in rows]
    assert not missing, "sections of docs/results.md with a table and no row in bench/README.md: " + ", ".join(missing)
    no_command = [a for a, cell in rows.items() if not COMMAND.search(cell)]
    assert not no_command, "bench/README.md rows without a command: " + ", ".join(no_command)
    stale = sorted(set(rows) - _anchors(RESULTS_DOC))
    assert not stale, "bench/README.md rows for sections docs/results.md no longer has: " + ", ".join(stale)


@pytest.mark.parametrize("page", [RESULTS_DOC, README, BENCH / "results" / "archive" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for number, line in _prose(page):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            where, _, anchor = target.partition("#")
            path = (page.parent / where).resolve() if where else page
            if not path.exists():
                broken.append(f"{number}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{number}: {target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_results_folder_is_described():
    """Each folder of bench/results is a script's (``bench/<folder>.py``), a kvcompile command's, or the archive,
    and bench/README.md says what makes it."""
    text = README.read_text(encoding="utf-8")
    folders = sorted(p.name for p in (BENCH / "results").iterdir() if p.is_dir())
    unknown = [f for f in folders if not ((BENCH / f"{f}.py").exists() or f.startswith("kvcompile-") or f == "archive")]
    assert not unknown, f"result folders made by no script or command: {unknown}"
    undescribed = [f for f in folders if f"{f}/" not in text]
    assert not undescribed, f"result folders bench/README.md does not mention: {undescribed}"
