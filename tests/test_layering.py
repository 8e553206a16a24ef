"""The package's shape: layers point one way (import-linter contracts in pyproject.toml), modules stay small."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed (pip install -e '.[test]')")
def test_layers_point_one_way():
    run = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 kept, 0 broken" in run.stdout


def test_no_module_is_long():
    """One concept per module: none over 300 lines."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "kvcompile").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines: {long}"
