"""The documentation holds together: every relative link in README.md and docs/ reaches a file of the repository
(and, with an anchor, a heading of that file), every ``docs/<page>.md#anchor`` the code or the tests cite exists,
every built-in recipe, wrapper and page format has a section in the method pages, and nothing cites a document
that is not in the repository."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
CITED_PAGE = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")
# documents that live outside the repository (the team's private notes): nothing may cite them
OUTSIDE = re.compile(r"METHODS\.md|METHODS §|METHODS section|DESIGN\.md|STYLE\.md|shared/|\bresearch/[\w-]+\.md")
SECTION_NUMBER = re.compile(r"§\s?\d")  # the private notes' section numbers, meaningless without them


def _prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and emphasis reduced to their text, lowercase, every character but
    letters, digits, underscores, hyphens and spaces dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, a repeated one suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _links(path: Path):
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, m.group(1)


def _check(source: Path, number: int, target: str) -> str | None:
    """What is wrong with one relative link (None: it resolves)."""
    where, _, anchor = target.partition("#")
    path = source if not where else (source.parent / where).resolve()
    if not path.exists():
        return f"{source.relative_to(ROOT)}:{number}: {target}: no such file"
    if ROOT not in path.parents and path != ROOT:
        return f"{source.relative_to(ROOT)}:{number}: {target}: outside the repository"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{source.relative_to(ROOT)}:{number}: {target}: no heading with anchor #{anchor} in {path.name}"
    return None


def test_slugs_follow_github():
    assert slug("Ceiling analysis (`kvcompile.eval.analysis`, `kvcompile analyze ceiling`)") == (
        "ceiling-analysis-kvcompileevalanalysis-kvcompile-analyze-ceiling")
    assert slug("On a GPU: `bench/gpu_check.py` on an H200") == "on-a-gpu-benchgpu_checkpy-on-an-h200"
    assert slug("`adakv-snapkv`") == "adakv-snapkv"
    assert slug("KVzip's reconstruction") == "kvzips-reconstruction"


def test_every_relative_link_resolves():
    broken = []
    for page in DOC_PAGES:
        for number, target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not checked here
                continue
            problem = _check(page, number, target)
            if problem:
                broken.append(problem)
    assert not broken, "broken links:\n" + "\n".join(broken)


def _sources(*tops: str, suffixes=(".py", ".md")):
    for top in tops:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in suffixes)
        for f in files:
            if f.is_file() and f != Path(__file__).resolve() and "__pycache__" not in f.parts:
                yield f


def test_cited_doc_pages_resolve():
    """``docs/<page>.md#anchor`` in a docstring or comment of the code or the tests names an existing section."""
    broken = []
    for f in _sources("kvcompile", "tests", suffixes=(".py",)):
        for number, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITED_PAGE.finditer(line):
                page = ROOT / "docs" / m.group(1)
                if not page.exists():
                    broken.append(f"{f.relative_to(ROOT)}:{number}: docs/{m.group(1)}: no such page")
                elif m.group(2) and m.group(2) not in anchors(page):
                    broken.append(f"{f.relative_to(ROOT)}:{number}: docs/{m.group(1)}#{m.group(2)}: no such heading")
    assert not broken, "\n".join(broken)


def _lines_matching(top: str, pattern) -> list[str]:
    """``file:line: text`` of every line under ``top`` that ``pattern`` finds."""
    return [f"{f.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
            for f in _sources(top)
            for number, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line)]


@pytest.mark.parametrize("top", ["kvcompile", "tests", "bench", "README.md", "docs"])
def test_nothing_cites_a_document_outside_the_repository(top):
    found = _lines_matching(top, OUTSIDE)
    assert not found, "cites a document that is not in the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("top", ["kvcompile", "tests", "README.md", "docs"])
def test_no_section_numbers_of_outside_notes(top):
    """A bare "§N" pointed into the private notes; the code and the docs name the docs section or the paper."""
    found = _lines_matching(top, SECTION_NUMBER)
    assert not found, "section numbers of a document outside the repository:\n" + "\n".join(found)


def test_every_method_has_a_section():
    """docs/methods.md links every built-in recipe, wrapper and page format to its section (the link test
    checks that the section exists)."""
    import kvcompile
    from kvcompile.kernels.formats import FORMATS
    from kvcompile.recipes.compose import WRAPPERS

    index = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\[`([^`]+)`\]\([^)]*#[\w-]+\)", index))
    missing = sorted((set(kvcompile.recipes()) | set(WRAPPERS) | set(FORMATS)) - linked)
    assert not missing, f"no section linked from docs/methods.md for: {missing}"
