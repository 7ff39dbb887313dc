"""Loader: every source kind resolves or fails with a clear message."""

import json

import pytest
import torch

from engine.models.loader import ModelLoadError, load_model, parse_device, parse_dtype
from tests.tiny import tiny_hf, tiny_tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 checkpoint saved as a Hugging Face directory (safetensors + tokenizer)."""
    d = tmp_path_factory.mktemp("tiny-qwen2")
    model = tiny_hf("qwen2")
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d, model


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_loads_a_hf_directory_in_each_dtype(hf_dir, dtype, expected):
    d, ref = hf_dir
    lm = load_model(str(d), dtype=dtype)
    assert lm.model.dtype == expected
    assert lm.config.model_type == "qwen2" and lm.config.tie_word_embeddings
    assert lm.tokenizer.eos_token == "</s>"
    if dtype == "fp32":
        cache = lm.model.new_cache(1, 16)
        ids = torch.tensor([[1, 2, 3]])
        got = lm.model(ids, torch.arange(3)[None], cache, [cache.allocate()]).logits
        with torch.no_grad():
            assert (got - ref(ids).logits).abs().max() < 1e-4


def test_missing_path_names_what_was_tried(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope" / "model"), cache_dir=tmp_path)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(f), cache_dir=tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises((ModelLoadError, ValueError)):
        load_model(str(f), cache_dir=tmp_path / "cache")
    leftovers = list((tmp_path / "cache" / "converted").glob("*.tmp*")) if (tmp_path / "cache").exists() else []
    assert leftovers == []


def test_unsupported_architecture_in_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1,
                                                      "n_head": 2, "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="supported: llama, qwen2, mistral"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_hub_id_without_a_hub_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match="could not download 'someorg/somemodel'"):
        load_model("someorg/somemodel", cache_dir=tmp_path)


def test_dtype_and_device_validation():
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int3")
    with pytest.raises(ValueError):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_device("cuda")


def test_a_draft_takes_the_targets_tokenizer_only_when_the_files_are_the_same(tmp_path):
    from tests.fakes import make_tokenizer
    from tests.tiny import save_tiny_pair

    tok = make_tokenizer()
    save_tiny_pair(tmp_path, tok)
    (tmp_path / "draft" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # may differ
    target = load_model(str(tmp_path / "target"), dtype="fp32")
    draft = load_model(str(tmp_path / "draft"), dtype="fp32", tokenizer_of=target)
    assert draft.tokenizer is target.tokenizer

    config = json.loads((tmp_path / "draft" / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (tmp_path / "draft" / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_model(str(tmp_path / "draft"), dtype="fp32", tokenizer_of=target)
    assert other.tokenizer is not target.tokenizer and other.tokenizer.model_max_length == 77
    assert other.tokenizer.encode("the quick brown fox") == target.tokenizer.encode("the quick brown fox")
