"""GGUF block kernels (engine/models/csrc/quant_gemm.cpp): every block type against the ``gguf``
package's dequantize + an fp64 matmul of the kernel's rounded activations (exact up to fp32), and
within the activation rounding of the unrounded product (per 32, or per 256 for the k-quants); every row count 1..64 batch-invariant, odd
shapes refused."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.models import cpu_kernels, qweight
from engine.models.qweight import BLOCK_TYPES, QuantWeight, quantize_q8_0

ROOT = Path(__file__).resolve().parents[3]
_AVX512_VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # /proc/cpuinfo flags: the 512-bit kernels

pytestmark = pytest.mark.skipif(not qweight.available(), reason="CPU kernels unavailable on this machine")

TYPES = sorted(BLOCK_TYPES)


def random_blocks(type_id: int, n: int, k: int, seed: int = 0) -> QuantWeight:
    """A weight of random blocks: random quant bytes, with the fp16 scales set to sane values (random
    bytes there would be NaN or 1e4-sized)."""
    name, block, nbytes = BLOCK_TYPES[type_id]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // block, nbytes), generator=g, dtype=torch.uint8)

    def put_half(offset: int, scale: float) -> None:
        h = (torch.rand(n, k // block, generator=g) * scale + scale / 10).half()
        raw[..., offset:offset + 2] = h.view(torch.uint8).reshape(n, k // block, 2)

    if name == "Q6_K":
        put_half(208, 0.01)
    elif name in ("Q4_K", "Q5_K"):
        put_half(0, 0.01)
        put_half(2, 0.01)
    else:
        put_half(0, 0.05)
        if name == "Q4_1":
            put_half(2, 0.1)
    return QuantWeight(raw.reshape(n, -1), type_id, k)


def reference(w: QuantWeight) -> torch.Tensor:
    """The ``gguf`` package's dequantization (numpy), float32 [N, K]."""
    return torch.from_numpy(np.ascontiguousarray(
        quants.dequantize(w.rows().numpy(), GGMLQuantizationType(w.type_id))).astype(np.float32))


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_dequantize_matches_the_gguf_package(type_id):
    w = random_blocks(type_id, 24, 512)
    ours, ref = w.dequantize(), reference(w)
    assert ours.shape == ref.shape == (24, 512)
    # same formulas in fp32; a product of three factors may round once differently
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0), (ours - ref).abs().max()
    rows = torch.tensor([[3, 0], [23, 3]])
    assert torch.equal(w.dequantize(rows), ours[rows])


def activation_group(type_id: int) -> int:
    """The kernel rounds activations per 32 for the 32-weight blocks, per 256 (a super-block) for the
    k-quants."""
    return BLOCK_TYPES[type_id][1]


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding, in float32 as it does it: per group, dx = max|x| / 127 and
    q = round(x * (1 / dx)), ties to even.  Returns (q [M, K] as float64, dx [M, K/group])."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None])
    return q.reshape(m, k).double(), d.double()


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_linear_is_the_exact_product_of_the_rounded_activations(type_id):
    """The kernel computes sum_g dx_g * sum_i q_i w_i (g: groups of 32, or 256 for the k-quants); in fp64 from the gguf package's dequantized
    weights that is the same number up to fp32 rounding (relative 1e-6 of the magnitudes)."""
    w = random_blocks(type_id, 37, 768, seed=type_id)  # N not a multiple of the row tile
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    group = activation_group(type_id)
    q, dx = quantize_activations(x, group)
    xq = (q.view(5, -1, group) * dx[..., None]).view(5, 768)
    ref = reference(w).double()
    want = xq @ ref.T
    got = w.linear(x)
    assert got.dtype == torch.float32 and got.shape == (5, 37)
    scale = xq.abs() @ ref.abs().T
    assert ((got.double() - want).abs() / scale).max() < 1e-6
    bias = torch.randn(37)
    assert torch.equal(w.linear(x, bias), (w.linear(x) + bias))
    # bf16 activations are read as they are and the outputs rounded in the kernel: the bits of going
    # through fp32 and converting afterwards, bias included (added in fp32, then rounded once)
    xb, bb = x.bfloat16(), bias.bfloat16()
    assert w.linear(xb).dtype == torch.bfloat16
    assert torch.equal(w.linear(xb), w.linear(xb.float()).bfloat16())
    assert torch.equal(w.linear(xb, bb), (w.linear(xb.float()) + bb.float()).bfloat16())


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_linear_is_within_the_activation_rounding_of_fp32_math(type_id):
    """Against the unrounded product, the error is at most half a step per activation:
    |y - x @ W.T| <= sum_k |W_nk| dx_g(k) / 2 (plus fp32 slack).  About 0.3% of sum |W x| here."""
    w = random_blocks(type_id, 37, 768, seed=type_id)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    ref = reference(w).double()
    group = activation_group(type_id)
    _, dx = quantize_activations(x, group)
    step = dx.repeat_interleave(group, dim=1)  # [M, K]
    bound = step @ ref.abs().T / 2
    scale = x.double().abs() @ ref.abs().T
    err = (w.linear(x).double() - x.double() @ ref.T).abs()
    assert (err <= bound + 1e-6 * scale).all()
    assert (err / scale).max() < 1e-2


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_every_row_count_is_batch_invariant(type_id):
    """Row r of a call with M rows is bitwise the row computed alone, for M = 1..64, and the same
    with one thread and with two."""
    w = random_blocks(type_id, 19, 512, seed=3)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([w.linear(x[r:r + 1]) for r in range(64)])
    for m in range(1, 65):
        assert torch.equal(w.linear(x[:m]), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)
    assert torch.equal(w.linear(x.view(4, 16, 512)), alone.view(4, 16, 19))  # leading dims kept


def test_odd_shapes_are_refused_with_a_clear_error():
    w = random_blocks(12, 4, 256)
    with pytest.raises(RuntimeError, match="x has 255 columns"):
        w.linear(torch.randn(2, 255))
    raw = w.rows()
    with pytest.raises(RuntimeError, match="not a multiple of the Q4_K block size 256"):
        torch.ops.mcsd_cpu.quant_linear(torch.randn(1, 128), raw, 12, 128)
    with pytest.raises(RuntimeError, match="take 144 bytes"):
        torch.ops.mcsd_cpu.quant_linear(torch.randn(1, 256), raw[:, :100].contiguous(), 12, 256)
    with pytest.raises(RuntimeError, match="unsupported GGML block type 10"):
        torch.ops.mcsd_cpu.quant_linear(torch.randn(1, 256), raw, 10, 256)
    with pytest.raises(RuntimeError, match="Q4_K weights run packed"):
        torch.ops.mcsd_cpu.quant_linear(torch.randn(1, 256), raw, 12, 256)
    with pytest.raises(RuntimeError, match="packed Q4_K groups of K = 256 take 1184 bytes"):
        torch.ops.mcsd_cpu.quant_linear(torch.randn(1, 256), w.data[:, :1000].contiguous(), 12 | 256, 256)
    with pytest.raises(RuntimeError, match="Q4_0 rows of K = 64 take 36 bytes"):
        torch.ops.mcsd_cpu.quant_pack(torch.zeros(2, 18, dtype=torch.uint8), 2, 64)
    with pytest.raises(RuntimeError, match="row 8 is outside the weight's 8 rows"):
        torch.ops.mcsd_cpu.quant_unpack(w.data, 12, 256, torch.tensor([8]))
    with pytest.raises(IndexError, match="out of range"):
        w.rows(torch.tensor([4]))  # 4 rows, packed in a group of 8
    with pytest.raises(ValueError, match="rows hold multiples of 32"):
        QuantWeight(torch.zeros(2, 18, dtype=torch.uint8), 2, 40)
    with pytest.raises(ValueError, match="not supported"):
        QuantWeight(torch.zeros(2, 18, dtype=torch.uint8), 10, 32)
    assert w.linear(torch.randn(0, 256)).shape == (0, 4)


def test_q8_0_quantization_is_the_gguf_layout_and_close():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 96, generator=g)
    q = quantize_q8_0(w)
    assert q.nbytes == 16 * 3 * 34 and q.type_name == "Q8_0"
    ref = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    # llama.cpp's rounding (and so the gguf package's) may differ from torch.round by one step at exact halves
    assert np.abs(q.rows().numpy().astype(np.int16) - ref.astype(np.int16)).max() <= 1
    assert torch.allclose(q.dequantize(), reference(q))
    assert (q.dequantize() - w).abs().max() <= w.abs().max() / 127  # half a quantization step, rounded scale


def test_q4_k_quantization_is_the_gguf_layout_and_close(monkeypatch):
    """quantize_q4_k writes blocks the gguf package decodes to our dequantization, including a zero
    super-block, an all-positive sub-block (min 0) and an outlier; 4.5 bits a weight stay within 7.5%
    RMS of Gaussian weights, and the least-squares grid beats the min-max fit it starts from."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 768, generator=g) * 0.02
    w[3, :256] = 0.0
    w[4, :32] = w[4, :32].abs() + 0.3
    w[5, 40] = 1.0
    q = qweight.quantize_q4_k(w)
    assert q.type_name == "Q4_K" and q.rows().shape == (24, 3 * 144)
    ours = q.dequantize()
    assert torch.allclose(ours, reference(q))  # the gguf package reads our bytes as we do
    assert torch.equal(ours[3, :256], torch.zeros(256))
    assert (ours[4, :32] >= 0).all() and (ours[4, :32] - w[4, :32]).abs().max() < 0.02
    ordinary = torch.ones(24, dtype=torch.bool)
    ordinary[[3, 4, 5]] = False
    rel = lambda deq: ((deq - w)[ordinary].pow(2).mean() / w[ordinary].pow(2).mean()).sqrt()  # noqa: E731
    assert rel(ours) < 0.075
    monkeypatch.setattr(qweight, "_Q4K_STEPS", (15.0,))
    assert rel(ours) < rel(qweight.quantize_q4_k(w).dequantize())
    with pytest.raises(ValueError, match="Q4_K needs K divisible by 256"):
        qweight.quantize_q4_k(torch.zeros(2, 96))


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_weights_are_packed_and_give_back_their_gguf_bytes(type_id):
    """Weights are stored packed (groups of 8 rows, the last padded); rows() is the GGUF bytes,
    exactly, for any bytes (every bit of the k-quants' 6-bit scale encoding survives the round trip)."""
    name, _, nbytes = BLOCK_TYPES[type_id]
    g = torch.Generator().manual_seed(type_id)
    raw = torch.randint(0, 256, (13, 768 // BLOCK_TYPES[type_id][1] * nbytes), generator=g, dtype=torch.uint8)
    w = QuantWeight(raw.clone(), type_id, 768)
    assert w.packed and w.shape == (13, 768) and w.data.shape[0] == 2
    assert torch.equal(w.rows(), raw)
    idx = torch.tensor([12, 0, 7, 8, 7])
    assert torch.equal(w.rows(idx), raw[idx])
    assert torch.equal(w.select(idx).rows(), raw[idx])
    # stacking: whole groups stay packed as they are, a padded part is repacked
    eight = QuantWeight(raw[:8].clone(), type_id, 768)
    both = QuantWeight.concat([eight, eight])
    assert both.packed and both.shape == (16, 768) and torch.equal(both.rows(), torch.cat([raw[:8], raw[:8]]))
    assert torch.equal(QuantWeight.concat([w, eight]).rows(), torch.cat([raw, raw[:8]]))
    with pytest.raises(ValueError, match="one block type"):
        QuantWeight.concat([w, random_blocks(14 if type_id == 2 else 2, 4, 768)])


@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_a_padded_group_keeps_the_shape_and_the_bias(type_id):
    """N not a multiple of 8: the padding rows never show, and a row's output is the same as in a
    weight of whole groups."""
    w = random_blocks(type_id, 11, 512, seed=8)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(11)
    whole = QuantWeight.concat([w, w.select(torch.arange(5))])  # 16 rows: two whole groups
    assert whole.shape == (16, 512)
    y = w.linear(x, bias)
    assert y.shape == (3, 11) and y.is_contiguous()
    assert torch.equal(y, whole.linear(x)[:, :11] + bias)
    xb, bb = x.bfloat16(), bias.bfloat16()  # the bias is added in fp32, then rounded once, as for whole groups
    assert torch.equal(w.linear(xb, bb), whole.linear(xb, torch.cat([bb, bb.new_zeros(5)]))[:, :11])


@pytest.mark.parametrize("isa", ["avx512", "avxvnni"])
@pytest.mark.parametrize("type_id", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_the_wider_kernels_give_the_same_bits(type_id, isa):
    """Where the CPU has AVX-512 with VNNI (or AVX-VNNI), those kernels can be switched on, and every
    row count gives bitwise the 256-bit AVX2 kernels' result (so batch invariance and the exactness
    tests above carry over).  Elsewhere asking for them is a clear error and the kernels in use stay."""
    flags = cpu_kernels.cpu_flags() or set()
    has = _AVX512_VNNI <= flags if isa == "avx512" else "avx_vnni" in flags
    before = qweight.kernel_isa()
    if not has or before == "portable":
        with pytest.raises(RuntimeError, match="no AVX-512" if isa == "avx512" else "no AVX-VNNI"):
            qweight.kernel_isa(isa)
        assert qweight.kernel_isa() == before
        return
    w = random_blocks(type_id, 21, 768, seed=5)
    x = torch.randn(64, 768, generator=torch.Generator().manual_seed(6))
    try:
        assert qweight.kernel_isa("avx2") == "avx2"
        narrow = [w.linear(x[:m]) for m in range(1, 65)]
        assert qweight.kernel_isa(isa) == isa
        for m in range(1, 65):
            assert torch.equal(w.linear(x[:m]), narrow[m - 1]), m
    finally:
        qweight.kernel_isa(before)
    with pytest.raises(RuntimeError, match="expected 'avx512'"):
        qweight.kernel_isa("sse")


def test_the_default_kernels_are_the_widest_the_cpu_has():
    """Without MCSD_CPU_ISA, a process starts on the 512-bit kernels where the CPU has AVX-512 with
    VNNI, else on the AVX-VNNI ones where it has those, else on the AVX2 ones; MCSD_CPU_ISA=avx2 and
    =avxvnni start it on those (avxvnni only where the CPU has it)."""
    flags = cpu_kernels.cpu_flags() or set()
    if cpu_kernels.build_kind() == "portable":
        want = "portable"
    elif _AVX512_VNNI <= flags:
        want = "avx512"
    elif "avx_vnni" in flags:
        want = "avxvnni"
    else:
        want = "avx2"
    narrow = "portable" if want == "portable" else "avx2"
    vnni = "avxvnni" if want != "portable" and "avx_vnni" in flags else narrow
    code = "from engine.models import qweight; print(qweight.kernel_isa())"
    env = {k: v for k, v in os.environ.items() if k != "MCSD_CPU_ISA"}
    for setting, expected in ((None, want), ("avx2", narrow), ("avxvnni", vnni)):
        run_env = env if setting is None else {**env, "MCSD_CPU_ISA": setting}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, cwd=ROOT, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == expected, setting
