"""A second architecture through the model interface: Qwen3 (per-head q/k norms) is one module
(``engine.models.qwen3``) and one registry entry; the loader, the runner, the proposer and the cost
model take it unchanged.  Its logits are checked against ``transformers`` in ``test_llama.py``."""

from __future__ import annotations

import pytest
import torch

from engine.models.config import ARCHITECTURES, ModelConfig
from engine.models.loader import load_model
from engine.models.model import Model
from engine.models.qwen3 import Qwen3Model
from engine.request import SpecOptions
from tests.engine_utils import run_engine
from tests.tiny import VOCAB, hf_logits, tiny_hf, tiny_loaded, tiny_tokenizer


def test_every_registered_architecture_is_a_model():
    for model_type in ARCHITECTURES:
        cls = ModelConfig.from_hf(tiny_hf("qwen3").config.to_dict() | {"model_type": model_type}).model_class()
        assert issubclass(cls, torch.nn.Module) and hasattr(cls, "layer_extras"), model_type
    assert isinstance(tiny_loaded("qwen3").model, Model)


def test_a_qwen3_directory_loads_as_qwen3(tmp_path):
    hf = tiny_hf("qwen3")
    hf.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="fp32")
    assert type(loaded.model) is Qwen3Model and loaded.config.head_dim == 32 != loaded.config.hidden_size // 4
    ids = torch.randint(0, VOCAB, (12,)).tolist()
    cache = loaded.model.new_cache(1, 32)
    out = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [cache.allocate()])
    assert (out.logits[0] - hf_logits(hf, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("method", ["mcsd", "mcsd+maxgram", "cascade"])
def test_speculation_on_qwen3_equals_plain_decoding(method):
    target, draft = tiny_loaded("qwen3", seed=0), tiny_loaded("qwen3", seed=1, layers=1)
    prompts = [[5, 6, 7, 8, 5, 6], [11, 12, 13]]
    plain, _ = run_engine(target, None, prompts, tree=(), ignore_eos=True)
    outs, _ = run_engine(target, draft, prompts, tree=(3, 2, 1), ignore_eos=True, spec=SpecOptions(method=method))
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert sum(o.spec.drafted_tokens for o in outs) > 0


def test_qwen3_in_bf16_does_not_take_the_llama_layer_operator():
    """The CPU's fused layer operator computes the Llama layer; a Qwen3 model runs layer by layer
    (its bf16 logits stay close to the fp32 ones)."""
    from engine.models.llama import FusedStack

    fp32, bf16 = tiny_loaded("qwen3").model, tiny_loaded("qwen3", dtype=torch.bfloat16).model
    assert FusedStack.build(bf16) is None
    ids = torch.randint(0, VOCAB, (10,)).tolist()
    outs = []
    for m in (fp32, bf16):
        cache = m.new_cache(1, 32)
        outs.append(m(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [cache.allocate()]).logits[0])
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[0].abs().max()
