"""The portable build of the CPU kernels: what CPUs without AVX2 + FMA (aarch64, older x86) run.

It is built here too (``MCSD_CPU_BUILD=portable``, in a child process: one process loads one build)
and must give the vector build's bits for every linear (bf16, fp32 and all GGUF block types), so a
quantized model computes the same logits on any CPU.  Attention and the fp32 layer operations reduce
in another order there: close, and batch-invariant within the build."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models import cpu_kernels
from engine.models.qweight import BLOCK_TYPES, QuantWeight
from tests.engine.models.test_qweight import random_blocks

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"
)

ROOT = Path(__file__).resolve().parents[3]

# Runs in the child: the inputs' outputs under the portable build (``_here``), and attention's batch
# invariance there.
CHILD = r"""
import sys
import torch
from engine.models import cpu_kernels
from tests.engine.models.test_portable_build import _here

assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
inputs = torch.load(sys.argv[1])
outputs = _here(inputs)
for key, item in inputs.items():
    if key.startswith("att"):
        q, k, v, mask = item["q"], item["k"], item["v"], item["mask"]
        alone = torch.cat([cpu_kernels.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1])
                           for t in range(q.shape[2])], dim=2)
        assert torch.equal(outputs[key], alone), f"{key}: a query's attention depends on the block it is in"
outputs.update(build=cpu_kernels.build_kind(), quant_isa=torch.ops.mcsd_cpu.quant_isa(""),
               vector_isa=torch.ops.mcsd_cpu.vector_isa(""))
torch.save(outputs, sys.argv[2])
"""


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    inputs = {}
    for n, k in ((21, 272), (8, 16), (5, 100)):
        for dtype in (torch.bfloat16, torch.float32):
            for m in (1, 2, 3, 4, 5, 17):
                inputs[f"lin {n}x{k} {dtype} m{m}"] = {
                    "x": torch.randn(m, k, generator=g).to(dtype), "w": torch.randn(n, k, generator=g).to(dtype),
                    "b": torch.randn(n, generator=g).to(dtype)}
    for type_id in BLOCK_TYPES:
        for m in (1, 3, 8, 9, 17):
            inputs[f"quant {type_id} m{m}"] = {
                "rows": random_blocks(type_id, 13, 512, seed=10 * type_id + m).rows(), "type_id": type_id, "k": 512,
                "x": torch.randn(m, 512, generator=g), "b": torch.randn(13, generator=g)}
    for dtype in (torch.float32, torch.bfloat16):
        for d in (64, 128, 24):
            inputs[f"att {dtype} {d}"] = {
                "q": torch.randn(2, 4, 5, d, generator=g).to(dtype), "k": torch.randn(2, 2, 37, d, generator=g).to(dtype),
                "v": torch.randn(2, 2, 37, d, generator=g).to(dtype), "mask": torch.rand(2, 1, 5, 37, generator=g) > 0.3}
        inputs[f"rows {dtype}"] = {
            "x": torch.randn(3, 200, generator=g).to(dtype), "r": torch.randn(3, 200, generator=g).to(dtype),
            "w": torch.randn(200, generator=g).to(dtype), "gate_up": (torch.randn(3, 2 * 136, generator=g) * 4).to(dtype),
            "rx": torch.randn(1, 3, 2, 64, generator=g).to(dtype), "cos": torch.randn(1, 3, 1, 64, generator=g).to(dtype),
            "sin": torch.randn(1, 3, 1, 64, generator=g).to(dtype)}
    return inputs


def _here(inputs: dict) -> dict:
    """Every operator's outputs on ``inputs`` under this process's build."""
    outputs = {}
    for key, item in inputs.items():
        kind = key.split()[0]
        if kind == "lin":
            op = torch.ops.mcsd_cpu.bf16_linear if item["x"].dtype == torch.bfloat16 else torch.ops.mcsd_cpu.f32_linear
            outputs[key] = op(item["x"], item["w"], item["b"])
        elif kind == "quant":
            w = QuantWeight(item["rows"], item["type_id"], item["k"])
            outputs[key], outputs[key + " dequantized"] = w.linear(item["x"], item["b"]), w.dequantize()
        elif kind == "att":
            outputs[key] = cpu_kernels.attention(item["q"], item["k"], item["v"], item["mask"])
        elif kind == "rows":
            x, r, w = item["x"], item["r"], item["w"]
            outputs[key + " rms_norm"] = cpu_kernels.rms_norm(x, w, 1e-6)
            outputs[key + " add_rms_norm"] = torch.cat(cpu_kernels.add_rms_norm(x, r, w, 1e-6))
            outputs[key + " silu_mul"] = cpu_kernels.silu_mul(item["gate_up"])
            outputs[key + " rotary"] = cpu_kernels.rotary(item["rx"], item["cos"], item["sin"])
    return outputs


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """(inputs, the portable build's outputs): one child process, which builds the library once per
    machine (about 20 s on 2 cores) and reuses it after."""
    tmp = tmp_path_factory.mktemp("portable")
    inputs = _inputs()
    torch.save(inputs, tmp / "inputs.pt")
    env = {**os.environ, "MCSD_CPU_BUILD": "portable", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return inputs, torch.load(tmp / "outputs.pt")


def test_the_portable_build_is_the_one_asked_for(portable):
    _, out = portable
    assert (out["build"], out["quant_isa"], out["vector_isa"]) == ("portable", "portable", "portable")


def test_the_portable_linears_give_the_vector_builds_bits(portable):
    inputs, out = portable
    here = _here(inputs)
    keys = [k for k in here if k.startswith(("lin", "quant")) or k.endswith("rotary")]
    assert len(keys) == 36 + 2 * 5 * len(BLOCK_TYPES) + 2
    differ = [k for k in keys if not torch.equal(here[k], out[k])]
    assert not differ, f"the portable build's bits differ for {differ}"


def test_the_portable_attention_and_layer_operations_are_close(portable):
    inputs, out = portable
    here = _here(inputs)
    keys = [k for k in here if k.startswith(("att", "rows")) and not k.endswith("rotary")]
    assert len(keys) == 12
    for key in keys:
        tol = 1e-5 if here[key].dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[key].float(), here[key].float(), rtol=tol, atol=tol, msg=key)
