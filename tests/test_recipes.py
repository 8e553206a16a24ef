"""Recipe identity: fingerprints tie behaviour to versions, and every built-in recipe states its provenance."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvcompile
from kvcompile.cli import main as cli
from kvcompile.eval.sweep import markdown
from kvcompile.recipes import PROVENANCE, RECIPES, WRAPPERS, Recipe
from kvcompile.recipes.fingerprint import check_fingerprints, code_closure, code_roots

PROBE = '''
from kvcompile.methods.base import Scorer

OFFSET = 1


def helper(x):
    return x + OFFSET


class Probe(Scorer):
    def score(self, obs):
        return helper(obs.keys)
'''


def probe_code(tmp_path, source: str) -> dict:
    """The code closure of ``Probe`` in a module ``fp_probe`` made from ``source`` (the same name every time, so
    only the code can differ)."""
    path = tmp_path / f"v{len(list(tmp_path.iterdir()))}" / "fp_probe.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("fp_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fp_probe"] = module  # inspect.getsource finds a class's file through its module
    try:
        spec.loader.exec_module(module)
        return code_closure(module.Probe)
    finally:
        del sys.modules["fp_probe"]


# ------------------------------------------------------------------------------------------ fingerprints
def test_every_builtin_recipe_matches_its_recorded_fingerprint():
    messages = check_fingerprints()
    assert not messages, "\n".join(messages)


def test_changed_parameters_under_the_same_version_are_reported():
    snapkv = RECIPES["snapkv"]
    changed = dataclasses.replace(snapkv, scorer_args={"window": 64, "kernel": 7})
    assert changed.fingerprint != snapkv.fingerprint
    (message,) = check_fingerprints([changed])
    assert message.startswith(f"recipe 'snapkv'@{snapkv.version}: its code or parameters changed")
    assert "bump its version" in message
    (message,) = check_fingerprints([dataclasses.replace(changed, version=snapkv.version + 1)])
    assert "not recorded at this version" in message and "--record" in message, "a bump must be recorded too"


def test_name_version_source_and_provenance_are_not_behaviour():
    snapkv = RECIPES["snapkv"]
    renamed = dataclasses.replace(snapkv, name="other", version=7, source="x", provenance="custom", inferred="y")
    assert renamed.fingerprint == snapkv.fingerprint


def test_a_changed_helper_or_constant_changes_the_fingerprint(tmp_path):
    base = probe_code(tmp_path, PROBE)
    # the base class, and what its code and annotations name
    assert set(base) == {"fp_probe.Probe", "fp_probe.helper", "fp_probe.OFFSET", "kvcompile.methods.base.Scorer",
                         "kvcompile.methods.base.Observation", "kvcompile.methods.base.SPAN_QUERIES",
                         "kvcompile.methods.sources.Source", "kvcompile.methods.sources.QueryWindow"}
    assert probe_code(tmp_path, PROBE.replace("return x + OFFSET", "return x - OFFSET")) != base
    assert probe_code(tmp_path, PROBE.replace("OFFSET = 1", "OFFSET = 2")) != base


def test_docstrings_comments_and_formatting_leave_the_fingerprint_alone(tmp_path):
    base = probe_code(tmp_path, PROBE)
    cosmetic = PROBE.replace("def helper(x):\n", 'def helper(x):\n    """Add the offset."""\n    # a comment\n')
    cosmetic = cosmetic.replace("class Probe(Scorer):\n", 'class Probe(Scorer):\n    """A test scorer."""\n\n')
    cosmetic = cosmetic.replace("return x + OFFSET", "return (x +\n            OFFSET)  # wrapped")
    assert probe_code(tmp_path, cosmetic) == base


@pytest.mark.parametrize(("helper", "recipes"), [
    ("kvcompile.methods.base.merge_rankings", {"h2o", "sparse-finetune-h2o", "criticalkv", "adakv-criticalkv"}),
    ("kvcompile.methods.base.pooled_rank", {"adakv-snapkv", "adakv-expected-attention", "adakv-criticalkv", "kvzip",
                                          "kvgrad", "kvzip-plus", "kvcompose", "kvzap", "kvzap-hidden", "fastkvzip",
                                          "dms", "dms-decode", "abstain-kvzip", "restorekv"}),
])
def test_a_shared_helper_is_in_the_code_of_every_recipe_that_uses_it(helper, recipes):
    users = {name for name, r in RECIPES.items() if helper in code_closure(*code_roots(r))}
    assert users == recipes


def test_a_scorer_named_by_an_argument_is_part_of_the_code():
    assert "kvcompile.methods.snapkv.SnapKV" in code_closure(*code_roots(RECIPES["criticalkv"]))


def test_fingerprints_are_the_same_in_another_process_with_another_hash_seed():
    script = "from kvcompile.recipes import RECIPES; print(' '.join(r.fingerprint for r in RECIPES.values()))"
    here = str(Path(kvcompile.__file__).parents[1])  # the same kvcompile as this process, installed or not
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": here}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [r.fingerprint for r in RECIPES.values()]


# ------------------------------------------------------------------------------------------ provenance
def test_every_builtin_recipe_states_its_provenance():
    assert len(RECIPES) == 76
    unstated = [name for name, r in RECIPES.items() if r.provenance == "custom"]
    assert not unstated, f"built-in recipes must state their evidence: {unstated}"
    assert {r.provenance for r in RECIPES.values()} <= set(PROVENANCE)


def test_an_unknown_provenance_is_refused():
    with pytest.raises(ValueError, match="provenance 'blog'"):
        Recipe("x", "snapkv", provenance="blog")
    assert Recipe("x", "snapkv").provenance == "custom"


def test_recipes_show_tag_provenance_and_what_is_inferred(capsys):
    assert str(kvcompile.recipes()["contourkv"]).startswith("contourkv@2: snapkv + contourkv (abstract; inferred: ")
    assert str(kvcompile.recipes()["full"]) == "full@1: nothing evicted + uniform (control)"
    assert cli(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| recipe | provenance | inferred | source |" and lines[2 + len(RECIPES)] == ""
    assert lines[3 + len(RECIPES)].startswith("| wrapper (compose as wrapper+recipe) |")
    assert len(lines) == 2 + len(RECIPES) + 3 + len(WRAPPERS) + 1
    assert "| h2o@3 | peer | ranked once after prefill" in "\n".join(lines)
    assert "| chunkkv@2 | peer |" in "\n".join(lines)


def test_the_sweep_table_shows_provenance_next_to_the_recipe_tag():
    row = {"task": "passkey", "recipe": "h2o", "version": 2, "fingerprint": "7f71", "provenance": "peer",
           "budget": "0.25", "score": 1.0, "n": 1, "bytes_held_mean": 1024.0, "held_fraction": 0.25, "wall_s": 1.0,
           "kl_mean": None, "kl_p99": None, "top1": None, "uor": None, "query_aware": False, "error": None}
    config = {"length": 64, "n_samples": 1, "seed": 0}
    text = markdown({"rows": [row], "timing": {"shared_prefill_s": 1.0, "contexts": 1, "cells_s": 1.0},
                     "config": config})
    assert "| task | recipe | fingerprint | provenance | budget |" in text
    assert "| passkey | h2o@2 | 7f71 | peer | 0.25 |" in text
