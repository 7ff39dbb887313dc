"""GGUF weights kept in their blocks (engine/models/gguf_native.py, --quantize): a quantized model's
logits against its dequantized copy, greedy speculation token-identical to plain decoding on quantized
weights (the kernels are batch-invariant), the GGUF index reader, the q/k row un-permutation, and the
real SmolLM2 pack loaded natively."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.models import cpu_kernels, qweight
from engine.models.qweight import StackedWeight
from engine.models.gguf_native import _stack, _unpermute_rows, read_tensor_index, weight_bytes
from engine.models.qweight import QuantLinear, quantize_linears
from engine.request import SpecOptions
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

pytestmark = pytest.mark.skipif(not qweight.available(), reason="CPU kernels unavailable on this machine")


def quantized(lm):
    out = copy.copy(lm)
    out.model = quantize_linears(copy.deepcopy(lm.model), "q8_0")
    return out


def dequantized_copy(model):
    """The same model with every QuantLinear replaced by a dense fp32 linear of its dequantized weight."""
    dense = copy.deepcopy(model)
    for mod in [*dense.layers, dense]:
        for name, child in list(mod.named_children()):
            if isinstance(child, QuantLinear):
                w = child.weight.dequantize()
                lin = nn.Linear(w.shape[1], w.shape[0], bias=child.bias is not None)
                lin.weight = nn.Parameter(w, requires_grad=False)
                if child.bias is not None:
                    lin.bias = nn.Parameter(child.bias, requires_grad=False)
                setattr(mod, name, lin)
    return dense


def logits(model, ids):
    cache = model.new_cache(1, 64)
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [0]).logits[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_quantized_model_matches_its_dequantized_copy(kind):
    lm = tiny_loaded(kind, seed=0)
    q = quantized(lm).model
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) == 4 * len(q.layers) + 1
    assert weight_bytes(q) < weight_bytes(lm.model)
    ids = [5, 17, 3, 99, 42, 7, 7, 1]
    got, want = logits(q, ids), logits(dequantized_copy(q), ids)
    # the kernels round activations to int8 per 32 (exactness is tests/engine/models/test_qweight.py's); through a
    # whole model that stays within 2% of the largest logit, a wiring bug would be of order 1
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    # and Q8_0 stays close to the original fp32 weights
    assert (got - logits(lm.model, ids)).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_speculation_on_quantized_weights_equals_plain_decoding(kind):
    target, draft = quantized(tiny_loaded(kind, seed=0)), quantized(tiny_loaded(kind, seed=1, layers=1))
    prompts = [[5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3], [10, 11, 12]]
    plain = run_engine(target, None, prompts, tree=(), ignore_eos=True, max_tokens=20)[0]
    for method in ("mcsd", "mcsd+maxgram"):
        spec = run_engine(target, draft, prompts, tree=(2, 2, 1), ignore_eos=True, max_tokens=20,
                          spec=SpecOptions(method=method))[0]
        assert [o.tokens for o in spec] == [o.tokens for o in plain], method


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_q4_k_quantization_of_a_model_falls_back_to_q8_0_where_rows_are_not_whole_blocks(kind):
    """--quantize q4_k: every linear whose K is a multiple of 256 in Q4_K blocks, the others (here
    ffn_down, K = 288) in Q8_0; logits close to the dequantized copy's and to the dense model's, and
    greedy speculation on those weights token-identical to plain decoding."""
    lm = tiny_loaded(kind, seed=0, hidden=256, intermediate=288)
    q = copy.copy(lm)
    q.model = quantize_linears(copy.deepcopy(lm.model), "q4_k")
    types = {name: mod.weight.type_name for name, mod in q.model.named_modules() if isinstance(mod, QuantLinear)}
    assert len(types) == 4 * len(q.model.layers) + 1
    assert {t for n, t in types.items() if n.endswith("down_proj")} == {"Q8_0"}
    assert {t for n, t in types.items() if not n.endswith("down_proj")} == {"Q4_K"}
    ids = [5, 17, 3, 99, 42, 7, 7, 1]
    got, want = logits(q.model, ids), logits(dequantized_copy(q.model), ids)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    dense = logits(lm.model, ids)  # 4-bit weights of random tiny models: 9-12% of the largest logit; a
    assert (got - dense).abs().max() < 0.25 * dense.abs().max()  # wiring bug would be of order 1
    draft = copy.copy(q)
    draft.model = quantize_linears(tiny_loaded(kind, seed=1, layers=1, hidden=256, intermediate=288).model, "q4_k")
    prompts = [[5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3]]
    plain = run_engine(q, None, prompts, tree=(), ignore_eos=True, max_tokens=16)[0]
    spec = run_engine(q, draft, prompts, tree=(2, 2, 1), ignore_eos=True, max_tokens=16)[0]
    assert [o.tokens for o in spec] == [o.tokens for o in plain]


def test_quantize_refuses_unknown_formats():
    with pytest.raises(ValueError, match="unknown quantization 'q3'"):
        quantize_linears(tiny_loaded().model, "q3")


def test_unpermute_undoes_the_llama_cpp_rotary_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = torch.arange(n_head * head_dim * cols).reshape(n_head * head_dim, cols)
    # llama.cpp's converter: per head, rows (2, head_dim / 2) -> (head_dim / 2, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute_rows(permuted, n_head), w)


def test_the_index_reader_agrees_with_the_gguf_package(tmp_path):
    import gguf

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])  # a string array to skip
    writer.add_float32("some.value", 1.5)
    a = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.weight", a)
    writer.add_tensor("q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = read_tensor_index(path)
    raw = path.read_bytes()
    for t in gguf.GGUFReader(str(path)).tensors:
        info = index[t.name]
        assert info.type_id == int(t.tensor_type) and info.shape == tuple(int(d) for d in t.shape)
        assert raw[info.offset:info.offset + info.nbytes] == t.data.tobytes()


def test_the_metadata_reader_agrees_with_the_gguf_package(tmp_path):
    """read_metadata decodes every scalar type and strings as gguf.GGUFReader does, gives arrays as
    their type and length, and the tensor names in file order."""
    import gguf

    from engine.models.gguf_native import GGUFArray, read_metadata

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", [f"tok{i}" for i in range(300)])
    writer.add_array("t.ints", [1, 2, 3])
    for name in ("b.weight", "a.weight"):
        writer.add_tensor(name, np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, names = read_metadata(path)
    reader = gguf.GGUFReader(str(path))
    assert names == tuple(t.name for t in reader.tensors) == ("b.weight", "a.weight")
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own header fields
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert meta[key] == GGUFArray(int(field.types[1]), len(field.data)), key
        else:
            assert meta[key] == field.contents(), key
    assert meta["t.f32"] == float(np.float32(1e-6)) and meta["t.str"] == "héllo" and meta["t.bool"] is True


def _config_gguf(path: Path, arch: str, name: str, tied: bool, tokenizer_from: Path | None = None) -> Path:
    """A GGUF file of a tiny model's config, with a 40-token stand-in tokenizer, or the tokenizer of
    ``tokenizer_from`` (a GGUF file)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch in ("llama", "mistral"):
        writer.add_rope_dimension_count(16)
    if tokenizer_from is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(40)])
        writer.add_token_merges(["t 1"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        vocab = 40
    else:
        fields = gguf.GGUFReader(str(tokenizer_from)).fields
        writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
        writer.add_token_list(fields["tokenizer.ggml.tokens"].contents())
        writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
        writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
        writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"].contents())
        writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"].contents())
        vocab = len(fields["tokenizer.ggml.tokens"].data)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, 64), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((vocab, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,name,tied", [("qwen2", "tiny", True), ("llama", "tiny", False), ("llama", "mistral", True),
                                           ("mistral", "tiny", False)])
def test_the_fast_config_is_the_one_transformers_builds(tmp_path, arch, name, tied):
    """gguf_config (the metadata without the tokenizer's arrays) gives the config that transformers
    builds from the whole metadata: every field, the type (a llama file named "mistral" is Mistral), tied
    embeddings where the file has no output.weight, the vocabulary size from the token list."""
    from transformers import AutoConfig

    from engine.models.loader import gguf_config

    path = _config_gguf(tmp_path / "c.gguf", arch, name, tied)
    fast = gguf_config(path).to_dict()
    slow = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    fast.pop("_name_or_path", None), slow.pop("_name_or_path", None)
    assert fast == slow
    assert fast["tie_word_embeddings"] is tied and fast["vocab_size"] == 40
    assert fast["model_type"] == ("mistral" if name == "mistral" else arch)


def test_other_architectures_are_left_to_transformers(tmp_path):
    from engine.models.loader import gguf_config

    assert gguf_config(_config_gguf(tmp_path / "p.gguf", "phi3", "tiny", False)) is None


@pytest.mark.real_model
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_cached_config_and_tokenizer_are_the_ones_transformers_builds(tmp_path, arch):
    """The first start's cache (the fast config; for qwen2 the tokenizer class named by the type) holds
    the same files as transformers' own GGUF loading writes, and they tokenize the same.  SmolLM2's
    pack (llama), and a qwen2 file with its tokenizer."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from engine.models.fetch import fetch_pack
    from engine.models.loader import gguf_meta

    gguf = fetch_pack("smollm2-135m-instruct", progress=False)
    if arch == "qwen2":
        (tmp_path / "qwen").mkdir()
        gguf = _config_gguf(tmp_path / "qwen" / "q.gguf", "qwen2", "tiny", True, tokenizer_from=gguf)
    ours = gguf_meta(gguf, tmp_path / "cache")
    theirs = tmp_path / "theirs"
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(theirs)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(theirs)
    written = sorted(p.name for p in theirs.iterdir())
    assert written and written == sorted(p.name for p in ours.iterdir() if p.name != "mcsd-complete.json")
    for name in written:
        a, b = (ours / name).read_text(), (theirs / name).read_text()
        assert (json.loads(a) == json.loads(b)) if name.endswith(".json") else a == b, name
    text = "def fibonacci(n):\n    return n"
    assert AutoTokenizer.from_pretrained(ours).encode(text) == AutoTokenizer.from_pretrained(theirs).encode(text)


@pytest.mark.real_model
def test_the_smollm_pack_runs_in_its_own_blocks():
    from engine.models.fetch import fetch_pack
    from engine.models.loader import load_model

    gguf = fetch_pack("smollm2-135m-instruct", progress=False)
    native = load_model(str(gguf), dtype="fp32", gguf_weights="native")
    dense = load_model(str(gguf), dtype="fp32")
    assert any(isinstance(m, QuantLinear) for m in native.model.modules())
    assert weight_bytes(native.model) < weight_bytes(dense.model) / 4  # Q4_1 / Q8_0 blocks vs fp32
    ids = native.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n", add_special_tokens=False)
    got, want = logits(native.model, ids), logits(dense.model, ids)
    # int8 activations (per 32, as llama.cpp does) against fp32 math on the same weights: measured 5-8%
    # relative L2 at worst over these positions, every greedy token the same (tests/engine/models/test_qweight.py has
    # the exact per-kernel bounds)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.12
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompts = [ids, ids[:5]]
    plain = run_engine(native, None, prompts, tree=(), ignore_eos=True, max_tokens=16)[0]
    spec = run_engine(native, native, prompts, tree=(2, 1), ignore_eos=True, max_tokens=16)[0]
    assert [o.tokens for o in spec] == [o.tokens for o in plain]


@pytest.mark.real_model
def test_the_first_start_on_a_gguf_file_says_it_reads_the_metadata_once(tmp_path, caplog):
    """The first start on a GGUF file reads its config and tokenizer from the metadata: the server log
    says so, and how long it took; later starts read the cache silently and get the same files."""
    import logging

    from engine.models.fetch import fetch_pack
    from engine.models.loader import gguf_meta

    gguf = fetch_pack("smollm2-135m-instruct", progress=False)
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        first = gguf_meta(gguf, tmp_path)
    said = [r.getMessage() for r in caplog.records if r.name == "engine.models.loader"]
    assert any("first start on" in m and gguf.name in m for m in said), said
    assert any(m.startswith(f"cached {gguf.name}'s config and tokenizer in") for m in said), said
    assert (first / "config.json").is_file() and any(first.glob("tokenizer*"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        again = gguf_meta(gguf, tmp_path)
    assert again == first
    assert not [r for r in caplog.records if r.name == "engine.models.loader"]


def test_a_cut_draft_vocabulary_keeps_the_quantized_output_rows():
    from engine.models.vocab import OutputVocab

    model = quantize_linears(tiny_loaded("qwen2", seed=1).model, "q8_0")
    vocab = OutputVocab([0, 3, 7, 50], model.cfg.vocab_size, model.lm_head.weight)
    hidden = torch.randn(2, 5, model.cfg.hidden_size)
    full = model.lm_head.weight.linear(hidden).float()
    cut = vocab.logits(hidden)
    kept = torch.tensor([0, 3, 7, 50])
    assert torch.equal(cut[..., kept], full[..., kept])  # batch-invariant rows: bitwise the same
    assert torch.isinf(cut).sum() == 2 * 5 * (model.cfg.vocab_size - 4)


def test_stacked_parts_of_one_type_are_one_product():
    """A fused q/k/v whose parts differ in type: neighbours of one type are concatenated, so the
    forward makes one product per run, with the outputs of the parts side by side as before."""
    gen = torch.Generator().manual_seed(0)
    q, k = (qweight.quantize_q8_0(torch.randn(n, 64, generator=gen)) for n in (32, 16))
    v = torch.randn(16, 64, generator=gen)
    fused = _stack([q, k, v])
    assert isinstance(fused, StackedWeight) and len(fused.parts) == 2 and fused.shape == (64, 64)
    x = torch.randn(3, 64, generator=gen)
    separate = torch.cat([q.linear(x), k.linear(x), cpu_kernels.linear(x, v)], dim=-1)
    assert torch.equal(fused.linear(x), separate)  # the same products, side by side
    # the float part is the fp32 product (whose summation order is the kernel's, not torch's)
    torch.testing.assert_close(separate[:, 48:], x @ v.T, rtol=1e-5, atol=1e-5)
    assert isinstance(_stack([q, k]), qweight.QuantWeight) and torch.equal(_stack([v, v]), torch.cat([v, v]))
