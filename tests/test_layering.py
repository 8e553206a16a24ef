"""The package's shape: layers point one way (import-linter contracts in pyproject.toml), and ruff's rules hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None,
                    reason="import-linter is not installed (pip install -e '.[test]')")
def test_layers_point_one_way():
    run = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout



def test_ruff_finds_nothing():
    """Style by tools: the rule set in pyproject.toml ([tool.ruff]) over the whole tree."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
