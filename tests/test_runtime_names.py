"""The runtime knows contracts, never methods: no recipe, page format, scorer, allocator, wrapper or paper's method
name appears in a runtime module's identifiers or string constants (docstrings included).

``RUNTIME`` lists the modules treated as runtime. A page format's own modules (its codec in ``kernels``, its
encoder in ``anchoring``), the registries that name them (``kernels.formats``, ``encoding``, ``recipes``) and the
methods themselves are not runtime: adding a format or a method touches those, never a module listed here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvcompile
import kvcompile.eval.oracle  # noqa: F401  (registers its scorer: every registered name is looked for)
from kvcompile.kernels.formats import FORMATS
from kvcompile.methods import ALLOCATORS, SCORERS
from kvcompile.recipes import WRAPPERS

ROOT = Path(kvcompile.__file__).parent
RUNTIME = (
    "__init__.py", "capture.py", "passes", "programs.py", "program_store.py", "ops.py", "cache", "compress.py",
    "schedule.py", "model.py", "request.py", "generation.py", "speculative.py", "checks.py",
    "observation.py", "restoring.py", "rerotation.py", "plan.py", "signature.py", "spec.py", "budget.py", "artifact.py",
    "adapters.py", "segments.py", "early_stop.py", "gradients.py", "attention_inputs.py", "kernels/reference.py",
    "kernels/paging.py", "kernels/ragged.py", "kernels/cpu_native.py", "kernels/chooser.py", "kernels/triton_decode.py",
    "kernels/triton_compact.py", "kernels/flex.py", "kernels/format_pages.py", "kernels/codec.py",
)
# the papers' own spellings of methods whose registered names differ
PAPERS = ("ThinK", "AnchorKV", "SPECTRA", "SAKI", "KIVI", "Minima-KV", "FINCH", "KVzip", "SnapKV", "TOVA", "CertKV",
          "GraceKV", "KVgrad", "RestoreKV", "DuoAttention", "SimLayerKV", "HeadWiseKV", "KVzap", "FastKVzip", "KVpop",
          "TaskPress", "PyramidKV", "AdaKV", "ChunkKV", "KeyDiff", "StreamingLLM", "InertiaKV", "GrowPage",
          "CriticalKV", "LagKV", "KVCompose")
# registered names that are ordinary words of the runtime's own vocabulary (a page, a block, a threshold, ...)
WORDS = {"full", "random", "block", "chunk", "chunks", "decoding", "merging", "composed", "shares", "uniform",
         "threshold", "pages", "tokens", "prototypes", "tail-summary", "fill", "global-topk", "per-layer", "core",
         "cam", "reco", "ta", "oracle", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2"}


def _key(word: str) -> str:
    return re.sub(r"[^a-z0-9]", "", word.lower())


def method_names() -> dict[str, str]:
    """Every name to look for, by its letters and digits lower-cased (so "AnchorKV", "anchorkv" and "anchor_kv"
    are one)."""
    names = {*kvcompile.recipes(), *FORMATS, *SCORERS, *ALLOCATORS, *WRAPPERS, *PAPERS}
    out = {}
    for name in sorted(names, key=lambda n: (n not in PAPERS, n)):  # a paper's spelling names the finding
        if name not in WORDS and len(_key(name)) >= 3:
            out.setdefault(_key(name), name)
    return out


def texts(tree: ast.AST):
    """The identifiers and string constants of a module (docstrings included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.name
            yield node.asname or ""
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""
        elif isinstance(node, ast.keyword):
            yield node.arg or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def found_in(path: Path, names: dict[str, str]) -> set[str]:
    hits = set()
    for text in texts(ast.parse(path.read_text())):
        for word in re.findall(r"[A-Za-z][A-Za-z0-9_\-]*", text):
            for part in (word, *re.split(r"[_\-]", word)):
                if _key(part) in names:
                    hits.add(names[_key(part)])
    return hits


def runtime_files() -> list[Path]:
    out = []
    for entry in RUNTIME:
        path = ROOT / entry
        assert path.exists(), f"{entry} is listed as runtime but does not exist"
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def test_the_runtime_names_no_method():
    names = method_names()
    found = {str(p.relative_to(ROOT)): sorted(hits) for p in runtime_files() if (hits := found_in(p, names))}
    assert not found, f"method names in runtime modules: {found}"


def test_the_check_finds_a_name_in_code_and_in_a_docstring(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Reads SnapKV\'s window."""\n\ndef f(anchor_kv):\n    return "x"\n')
    assert found_in(module, method_names()) == {"SnapKV", "AnchorKV"}
