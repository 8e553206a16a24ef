"""The command line refuses a mistake in its arguments as a finished tool does: before any model loads, in one line
on stderr that names the command (``kvcompile eval: ...``), with exit status 2 and no traceback; ``--debug`` adds
the traceback, and a bug still shows its own.

Each subcommand (and one of the analyses) runs once in a real process (``RUNS``: the status, the stderr the user
sees), under a guard that ends the process with status 99 the moment anything loads a model; the wording of every
kind of refusal is checked in-process (``REFUSALS``), which is quicker than a process per case.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvcompile.models
from kvcompile import cli
from kvcompile.cli import commands

# ``python -c GUARD ARGS``: the kvcompile command, where loading any model ends the process with status 99
GUARD = """
import os, sys
import transformers
import kvcompile.models

def loaded(*args, **kwargs):
    print("a model was loaded", file=sys.stderr, flush=True)
    os._exit(99)

kvcompile.models.load_model = transformers.AutoModelForCausalLM.from_pretrained = loaded
from kvcompile.cli import main

main()
"""
LM_EVAL = ["lm-eval", "--model", "kvcompile", "--tasks", "kvc_passkey", "--model_args"]
RUNS = {  # one mistake per subcommand: (arguments, what the line says)
    "kvcompile eval": (["eval", "--recipes", "nosuch", "--budgets", "0.5"], "unknown recipe 'nosuch'"),
    "kvcompile demo": (["demo", "--recipe", "snapk"], "did you mean 'snapkv'"),
    "kvcompile report": (["report", "--store", "no/such/results.sqlite"], "no results store at"),
    "kvcompile fidelity": (["fidelity", "--budgets", "0.5,1.7"], "cannot read budget '1.7'"),
    "kvcompile lm-eval": ([*LM_EVAL, "pretrained=smollm2-135m,recipe=snapkv,budget=1.7"], "cannot read budget"),
    "kvcompile recipes": (["recipes", "--bogus"], "unrecognized arguments: --bogus"),
    "kvcompile analyze gap": (["analyze", "gap", "--n-samples", "0"], "--n-samples must be positive"),
    "kvcompile train": (["train", "kvzap", "--lengths", "256,0"], "'0' is not a positive whole number"),
    "kvcompile": (["evl"], "invalid choice: 'evl'"),
}


@pytest.fixture(scope="module")
def runs():
    """Every case of ``RUNS`` in its own process, two at a time (each spends its seconds importing torch)."""

    def run(args):
        return subprocess.run([sys.executable, "-c", GUARD, *args], capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RUNS, pool.map(run, [args for args, _ in RUNS.values()])))


@pytest.mark.parametrize("command", RUNS)
def test_a_mistake_is_one_line_and_status_2_before_any_model_loads(runs, command):
    done, says = runs[command], RUNS[command][1]
    assert done.returncode == 2, done.stderr  # 99: a model was loaded before the mistake was found
    assert "Traceback" not in done.stderr + done.stdout and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"{command}: ") and says in done.stderr


def test_without_triton_nothing_is_said_about_it():
    """torch logs a warning per Triton op registered when Triton is missing (the default install)."""
    code = "import sys; sys.modules['triton'] = None\nfrom kvcompile.cli import main\nmain(['--help'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and "usage: kvcompile" in done.stdout


REFUSALS = [  # (arguments, the line)
    (["eval", "--recipes", "snapk"],
     "kvcompile eval: unknown recipe 'snapk'; did you mean 'snapkv' or 'saki'? list them with: kvcompile recipes"),
    (["eval", "--recipes", "nosuch"], "kvcompile eval: unknown recipe 'nosuch'; list them with: kvcompile recipes"),
    (["eval", "--recipes", "snapkv+int5"], "kvcompile eval: unknown recipe or page format 'int5' in 'snapkv+int5'; "
     "did you mean 'int8' or 'int4' or 'int3'? list them with: kvcompile recipes"),
    (["eval", "--recipes", "chunkkv+full"],
     "kvcompile eval: recipe 'chunkkv+full': wrapper 'chunkkv' needs a recipe that evicts, got 'full'"),
    (["eval", "--recipes", ""], "kvcompile eval: --recipes is empty; give at least one, comma-separated"),
    (["eval", "--budgets", "64MiB,2GiBs"], "kvcompile eval: --budgets: cannot read budget '2GiBs': give a fraction "
     "of the context's KV bytes in (0, 1] (0.25), tokens per KV head (512) or a size (64MiB)"),
    (["eval", "--tasks", "passkey,vtt"], "kvcompile eval: unknown task 'vtt'; did you mean 'vt'? the tasks: "
     "niah_single_1, niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3, "
     "niah_multivalue, niah_multiquery, vt, cwe, fwe, passkey, credential, steps_chain, steps_chain1, steps_agent"),
    (["eval", "--model", "./no/such/folder"], "kvcompile eval: --model ./no/such/folder: no such model folder"),
    (["eval", "--n-samples", "x"], "kvcompile eval: argument --n-samples: invalid int value: 'x' "
     "(see kvcompile eval --help)"),
    (["eval", "--executor", "ray", "--measure-separate", "2"],
     "kvcompile eval: --measure-separate times one process; run it with --executor local"),
    (["demo", "--recipe", "full"], "kvcompile demo: recipe 'full' keeps every token, so its budget can only be 1.0 "
     "(got 0.5); pick a compressing recipe (list them with: kvcompile recipes)"),
    (["demo", "--depth", "1.5"], "kvcompile demo: --depth is where the pass key sits, from 0 (start) to 1 (end); "
     "got 1.5"),
    (["train", "sparse-finetune", "--budget", "2"], "kvcompile train: --budget must be a fraction in (0, 1], got 2.0"),
    (["train", "restorekv", "--budgets", "0.1,x"], "kvcompile train: --budgets must be a fraction in (0, 1], got x"),
    (["analyze"], "kvcompile analyze: the following arguments are required: analysis (see kvcompile analyze --help)"),
    (["analyze", "ceiling", "--budgets", "4,x"], "kvcompile analyze ceiling: --budgets: 'x' is not a positive whole "
     "number"),
    (["analyze", "queryleak", "--tasks", "passkee"], "kvcompile analyze queryleak: unknown task 'passkee'; did you "
     "mean 'passkey'? the tasks: niah_single_1, niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, "
     "niah_multikey_3, niah_multivalue, niah_multiquery, vt, cwe, fwe, passkey, credential, steps_chain, "
     "steps_chain1, steps_agent"),
    (["analyze", "nominal", "--recipes", "chunky+snapkv"], "kvcompile analyze nominal: unknown wrapper 'chunky' in "
     "'chunky+snapkv'; did you mean 'chunk' or 'chunkkv'? list them with: kvcompile recipes"),
    (["analyze", "diagnose", "--model", "smollm"], "kvcompile analyze diagnose: unknown model 'smollm'; did you mean "
     "'smollm2-135m'? the known models: smollm2-135m, gemma3-270m; or give a local model folder or a hub id "
     "(org/name)"),
    (["analyze", "diagnose", "--factor", "0"], "kvcompile analyze diagnose: --factor must be positive, got 0.0"),
    ([*LM_EVAL, "pretrained=smollm2-135m,budget=0.25"], "kvcompile lm-eval: recipe 'full' keeps every token, so its "
     "budget can only be 1.0 (got 0.25); pick a compressing recipe (list them with: kvcompile recipes)"),
    (["lm-eval", "--model", "hf", "--tasks", "kvc_passkey", "--store", "s.sqlite"],
     "kvcompile lm-eval: --store writes the kvcompile model's results; got --model hf"),
]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything asks for a model."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvcompile.models, "load_model", loaded)


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    err = capsys.readouterr().err
    assert raised.value.code == 2 and str(raised.value) + "\n" == err
    return err.rstrip("\n")


@pytest.mark.parametrize(("argv", "line"), REFUSALS, ids=[" ".join(argv) for argv, _ in REFUSALS])
def test_each_refusal_says_what_is_wrong_and_what_is_known(argv, line, no_model, capsys):
    assert refusal(argv, capsys) == line


def test_a_store_or_output_that_cannot_be_used_is_refused_untouched(tmp_path, no_model, capsys):
    not_a_store, a_file = tmp_path / "notes.sqlite", tmp_path / "file"
    not_a_store.write_text("not a database")
    a_file.write_text("")
    assert refusal(["eval", "--store", str(not_a_store)], capsys) == (
        f"kvcompile eval: {not_a_store} is not a SQLite database (file is not a database); give --store a new file "
        "name")
    assert refusal(["report", "--store", str(tmp_path)], capsys) == (
        f"kvcompile report: --store {tmp_path} is a folder; give a file name such as results.sqlite")
    assert refusal(["fidelity", "--out", str(a_file / "out.json")], capsys) == (
        f"kvcompile fidelity: --out {a_file / 'out.json'}: {a_file} is a file, not a folder")
    new = tmp_path / "new.sqlite"
    assert "unknown recipe" in refusal(["eval", "--store", str(new), "--recipes", "nosuch"], capsys)
    assert not new.exists()  # checking a store path creates nothing


def test_a_report_of_an_empty_store_is_a_refusal_too(tmp_path, no_model, capsys):
    from kvcompile.eval.store import Store

    Store(tmp_path / "empty.sqlite").close()
    assert refusal(["report", "--store", str(tmp_path / "empty.sqlite")], capsys) == (
        f"kvcompile report: {tmp_path / 'empty.sqlite'} holds no results yet "
        f"(kvcompile eval --store {tmp_path / 'empty.sqlite'})")


def test_debug_adds_the_traceback_anywhere_on_the_line(no_model, capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--recipes", "nosuch", "--debug"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert err[-1] == "kvcompile eval: unknown recipe 'nosuch'; list them with: kvcompile recipes"


def test_a_bug_is_not_dressed_as_a_mistake(monkeypatch):
    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(commands.RUN, "recipes", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["recipes"])


def test_valid_names_pass(no_model, monkeypatch):
    """Compositions, a hub id and every form of budget reach the command."""
    ran = []
    monkeypatch.setitem(commands.RUN, "eval", ran.append)
    cli.main(["eval", "--recipes", "chunkkv+decoding+snapkv,snapkv+int4,full+fp8", "--budgets", "0.25,512,64MiB",
              "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--tasks", "all"])
    assert len(ran) == 1
