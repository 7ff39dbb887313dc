"""The row-wise layer operations (csrc/layer_ops.cpp) against their torch formulation.

Where the kernel rounds at the same points as torch and does the same fp32 arithmetic (residual add,
rotary) it must agree bitwise.  The norm sums its squares in another order: its 1/rms differs in the
last fp32 bits, which moves an output by a few fp32 units in the last place (ulp), or by one bf16
rounding step twice (the normalised value, then the scaled one).  SiLU uses our exp (2e-7 relative).  Every row is computed alone:
bitwise the same whatever the other rows (batch invariance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"
)

DTYPES = [torch.bfloat16, torch.float32]
WIDTHS = [1536, 64, 13, 5]  # multiples of the 8 lanes, and scalar tails
NORM_ULPS = {torch.bfloat16: 2, torch.float32: 16}


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of the last place of their dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.bfloat16:
        ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    else:
        ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    # order the sign-magnitude bits as integers so that neighbouring floats differ by one
    sign = 0x8000 if a.dtype == torch.bfloat16 else 0x80000000
    ia, ib = (torch.where(i < 0, -(i & (sign - 1)), i) for i in (ia, ib))
    return int((ia - ib).abs().max()) if a.numel() else 0


def torch_norm(x, w, eps):
    return w * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
def test_rms_norm_matches_torch_within_one_ulp(dtype, n):
    x, w = randn(7, n, dtype=dtype, scale=3.0), randn(n, dtype=dtype, seed=1)
    ours = torch.ops.mcsd_cpu.rms_norm(x, w, 1e-6)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert ulps(ours, torch_norm(x, w, 1e-6)) <= NORM_ULPS[dtype]
    # a float32 weight with bfloat16 activations (checkpoints keep norms in fp32)
    if dtype == torch.bfloat16:
        wf = randn(n, dtype=torch.float32, seed=2)
        assert ulps(torch.ops.mcsd_cpu.rms_norm(x, wf, 1e-6), (wf * F.rms_norm(x.float(), (n,), eps=1e-6)
                                                               .to(dtype).float()).to(dtype)) <= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
def test_add_rms_norm_adds_exactly_and_normalises(dtype, n):
    x, d, w = randn(2, 3, n, dtype=dtype), randn(2, 3, n, dtype=dtype, seed=1), randn(n, dtype=dtype, seed=2)
    s, y = torch.ops.mcsd_cpu.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d)  # the same rounding as torch's add
    assert torch.equal(y, torch.ops.mcsd_cpu.rms_norm(x + d, w, 1e-5))
    assert ulps(y, torch_norm(x + d, w, 1e-5)) <= NORM_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64, 16, 6])  # 16 and 6: halves not a multiple of 8 lanes
def test_rotary_is_bitwise_torchs_on_strided_heads(dtype, head_dim):
    b, t, heads, extra = 2, 5, 3, 2
    # q/k heads as the forward has them: a slice of a wider projection (strided over tokens)
    wide = randn(b, t, (heads + extra) * head_dim, dtype=dtype)
    x = wide[..., :heads * head_dim].reshape(b, t, heads, head_dim)
    assert not x.is_contiguous()
    angles = randn(b, t, 1, head_dim // 2, dtype=torch.float32, seed=3)
    cos = torch.cat([angles, angles], -1).cos().to(dtype)
    sin = torch.cat([angles, angles], -1).sin().to(dtype)
    half = head_dim // 2
    expected = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    ours = torch.ops.mcsd_cpu.rotary(x, cos, sin)
    assert ours.is_contiguous() and torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8960, 64, 13])
def test_silu_mul_matches_torch(dtype, n):
    gu = randn(4, 2 * n, dtype=dtype, scale=4.0)
    gu[0, :6] = torch.tensor([-100.0, -87.5, 0.0, 30.0, 88.5, 200.0], dtype=dtype)  # exp's clamps
    gate, up = gu.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    ours = torch.ops.mcsd_cpu.silu_mul(gu)
    assert ours.shape == (4, n) and torch.isfinite(ours).all()
    assert ulps(ours, expected) <= (1 if dtype == torch.bfloat16 else 8)


def test_rows_are_computed_alone_bitwise():
    dt, n = torch.bfloat16, 1536
    x, d, w = randn(64, n, dtype=dt, scale=2.0), randn(64, n, dtype=dt, seed=1), randn(n, dtype=dt, seed=2)
    gu = randn(64, 2 * 320, dtype=dt, seed=3, scale=3.0)
    for rows in (1, 3, 64):
        assert torch.equal(torch.ops.mcsd_cpu.rms_norm(x[:rows], w, 1e-6), torch.ops.mcsd_cpu.rms_norm(x, w, 1e-6)[:rows])
        s, y = torch.ops.mcsd_cpu.add_rms_norm(x[:rows], d[:rows], w, 1e-6)
        assert torch.equal(y, torch.ops.mcsd_cpu.add_rms_norm(x, d, w, 1e-6)[1][:rows])
        assert torch.equal(torch.ops.mcsd_cpu.silu_mul(gu[:rows]), torch.ops.mcsd_cpu.silu_mul(gu)[:rows])


def test_bad_arguments_raise_clear_errors():
    x = randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.mcsd_cpu.rms_norm(x, torch.ones(15, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.mcsd_cpu.rms_norm(x.half(), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="same shape"):
        torch.ops.mcsd_cpu.add_rms_norm(x, x[:1], torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="even size"):
        torch.ops.mcsd_cpu.silu_mul(randn(2, 7, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.mcsd_cpu.rotary(x.view(1, 2, 1, 16), torch.ones(1, 2, 1, 8, dtype=torch.bfloat16),
                                  torch.ones(1, 2, 1, 8, dtype=torch.bfloat16))


def test_the_wrappers_fall_back_to_torch_where_the_kernels_do_not_apply(monkeypatch):
    """Off the CPU kernels (a GPU tensor, fp16, or MCSD_CPU_KERNELS=0) the wrappers compute the torch
    formulation; fp16 stands in for a device tensor here."""
    x, d, w = randn(3, 40, dtype=torch.float16), randn(3, 40, dtype=torch.float16, seed=1), randn(40, dtype=torch.float16)
    assert torch.equal(cpu_kernels.rms_norm(x, w, 1e-6), torch_norm(x, w, 1e-6))
    s, y = cpu_kernels.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d) and torch.equal(y, torch_norm(x + d, w, 1e-6))
    gate, up = x.chunk(2, -1)
    assert torch.equal(cpu_kernels.silu_mul(x), F.silu(gate) * up)
    called = []
    monkeypatch.setattr(torch.ops.mcsd_cpu, "silu_mul", lambda *a: called.append(a))
    cpu_kernels.silu_mul(x.float())
    assert called, "a float32 CPU tensor takes the kernel"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_same_bits_at_either_width(dtype):
    """Where the CPU has AVX-512F, silu_mul runs 16 lanes at a time with the 8-lane loop's operations
    (elementwise): the same bits, clamps and tails included."""
    gu = randn(5, 2 * 8960 + 2 * 13, dtype=dtype, scale=30.0)
    gu[0, :8] = torch.tensor([-100.0, -87.5, 0.0, 30.0, 88.5, 200.0, float("inf"), float("nan")], dtype=dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # NaN compared as bits
    before = torch.ops.mcsd_cpu.vector_isa()
    try:
        assert torch.ops.mcsd_cpu.vector_isa("avx2") == "avx2"
        narrow = torch.ops.mcsd_cpu.silu_mul(gu)
        if "avx512f" in (cpu_kernels.cpu_flags() or ()):
            assert torch.ops.mcsd_cpu.vector_isa("avx512") == "avx512"
            assert torch.equal(torch.ops.mcsd_cpu.silu_mul(gu).view(bits), narrow.view(bits))
        else:  # a CPU without AVX-512F: asking for it is a clear error
            with pytest.raises(RuntimeError, match="no AVX-512F"):
                torch.ops.mcsd_cpu.vector_isa("avx512")
    finally:
        torch.ops.mcsd_cpu.vector_isa(before)
