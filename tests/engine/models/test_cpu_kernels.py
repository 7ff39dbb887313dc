"""The AVX2 bf16 GEMM (engine/models/cpu_kernels.py): exact to bf16 rounding, and batch invariant.

Batch invariance is the property speculative decoding relies on: the output for one row is bitwise
the same whether it is computed alone (plain decoding, M=1) or among 16 draft tokens (verification),
whatever the other rows are and whatever the thread count.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.models import cpu_kernels
from tests import ROOT

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"bf16 CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"
)

MS = [1, 2, 3, 7, 16, 33, 64]
# (N, K): K multiple of 16, odd K, K < 16, odd N, N not a multiple of the 4/8-row blocks
SHAPES = [(64, 256), (37, 1000), (67, 1537), (5, 7), (130, 1536)]


def bf16_randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def reference_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """float64 reference, a rigorous error bound for round_bf16(fp32 accumulation), sum |terms|.

    |fp32 sum - exact| <= gamma * (sum_k |x_k w_k| + |b|) with gamma = (K + 8) * 2^-24 (FMA chain
    plus the 8-lane reduction and the bias add); rounding to bf16 (8 significant bits) adds at most
    2^-8 of the fp32 value.
    """
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if b is not None:
        ref = ref + b.double()
        mag = mag + b.double().abs()
    k = x.shape[-1]
    acc_err = (k + 8) * 2.0**-24 * mag
    return ref, 2.0**-8 * (ref.abs() + acc_err) + acc_err, mag


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_matches_float64_reference(m, n, k, with_bias):
    gen = torch.Generator().manual_seed(1000 * m + n + k)
    x = bf16_randn(m, k, gen=gen)
    w = bf16_randn(n, k, gen=gen)
    b = bf16_randn(n, gen=gen) if with_bias else None
    y = cpu_kernels.bf16_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref, tol, mag = reference_bound(x, w, b)
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max excess {(err - tol).max().item():.3g}"
    # Stronger, empirical: fp32 accumulation rounded once to bf16 is what torch's fp32 GEMM gives
    # too, up to the accumulation order: almost always bitwise, otherwise one bf16 ulp away --
    # except where heavy cancellation leaves a result tiny next to its terms (|ref| << sum |x w|),
    # there the fp32 rounding of either order may move it by more than a bf16 ulp.
    ref32 = F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    ulps = (bits(y).int() - bits(ref32).int()).abs()
    well_conditioned = ref.abs() >= 2.0**-12 * mag  # a bf16 ulp of ref >> fp32 rounding of the terms
    assert ulps[well_conditioned].max().item() <= 1
    assert (ulps == 0).float().mean().item() >= 0.97


def test_small_magnitudes_and_cancellation():
    # Inputs spanning many binades, outputs near zero through cancellation.
    gen = torch.Generator().manual_seed(7)
    k, n = 1537, 41
    x = (torch.randn(9, k, generator=gen) * torch.exp2(torch.randint(-20, 8, (9, k), generator=gen).float()))
    x = x.to(torch.bfloat16)
    w = bf16_randn(n, k, gen=gen, scale=1e-3)
    w[1] = -w[0]
    x[3] = x[2]
    y = cpu_kernels.bf16_linear(x, w)
    ref, tol, _ = reference_bound(x, w, None)
    assert ((y.double() - ref).abs() <= tol).all()


def test_leading_dims_and_strides():
    gen = torch.Generator().manual_seed(3)
    n, k = 67, 1537
    w = bf16_randn(n, k, gen=gen)
    b = bf16_randn(n, gen=gen)
    x = bf16_randn(2, 5, k, gen=gen)
    y = cpu_kernels.bf16_linear(x, w, b)
    assert y.shape == (2, 5, n)
    assert torch.equal(bits(y.reshape(10, n)), bits(cpu_kernels.bf16_linear(x.reshape(10, k), w, b)))
    # non-contiguous views: a transposed batch, a row slice with a stride
    xt = x.transpose(0, 1)  # [5, 2, k]
    assert torch.equal(bits(cpu_kernels.bf16_linear(xt, w, b)), bits(y.transpose(0, 1)))
    wide = bf16_randn(10, 2 * k, gen=gen)
    xs = wide[:, ::2]
    assert torch.equal(bits(cpu_kernels.bf16_linear(xs, w)), bits(cpu_kernels.bf16_linear(xs.contiguous(), w)))
    # 1-D input: a single row without a batch dim
    assert torch.equal(bits(cpu_kernels.bf16_linear(x[0, 0], w, b)), bits(y[0, 0]))


def test_empty_inputs():
    w = torch.ones(8, 16, dtype=torch.bfloat16)
    assert cpu_kernels.bf16_linear(torch.ones(0, 16, dtype=torch.bfloat16), w).shape == (0, 8)
    assert cpu_kernels.bf16_linear(torch.ones(2, 0, 16, dtype=torch.bfloat16), w).shape == (2, 0, 8)
    w0 = torch.ones(8, 0, dtype=torch.bfloat16)
    b = torch.arange(8).to(torch.bfloat16)
    y = cpu_kernels.bf16_linear(torch.ones(3, 0, dtype=torch.bfloat16), w0, b)
    assert torch.equal(y, b.expand(3, 8))


def test_nonfinite_propagate_like_torch():
    w = torch.ones(8, 40, dtype=torch.bfloat16)
    x = torch.ones(3, 40, dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, 39] = float("inf")  # in the K tail
    y = cpu_kernels.bf16_linear(x, w)
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert torch.equal(y[2], ref[2])


def test_bad_arguments_raise():
    w = torch.ones(8, 16, dtype=torch.bfloat16)
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        cpu_kernels.bf16_linear(x.float(), w)
    with pytest.raises(RuntimeError):
        cpu_kernels.bf16_linear(x, w.t().contiguous().t())  # non-contiguous weight
    with pytest.raises(RuntimeError):
        cpu_kernels.bf16_linear(torch.ones(2, 15, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError):
        cpu_kernels.bf16_linear(x, w, torch.ones(7, dtype=torch.bfloat16))


@pytest.mark.parametrize("n,k", [(67, 1537), (1030, 1536), (4099, 1000)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_batch_invariance_bitwise(n, k, with_bias):
    gen = torch.Generator().manual_seed(n + k)
    w = bf16_randn(n, k, gen=gen)
    b = bf16_randn(n, gen=gen) if with_bias else None
    rows = bf16_randn(4, k, gen=gen)
    alone = [cpu_kernels.bf16_linear(rows[i : i + 1], w, b) for i in range(4)]
    for m in MS[1:]:
        # the probe rows at several positions (every tile slot), among random rows of other scales
        others = bf16_randn(m, k, gen=gen, scale=float(torch.rand(1, generator=gen)) * 100)
        for i in range(4):
            pos = (i * 5) % m
            batch = others.clone()
            batch[pos] = rows[i]
            y = cpu_kernels.bf16_linear(batch, w, b)
            assert torch.equal(bits(y[pos : pos + 1]), bits(alone[i])), f"M={m} row {i} at {pos}"
        # and as a [B, T, K] batch
        if m % 2 == 0:
            y3 = cpu_kernels.bf16_linear(others.view(2, m // 2, k), w, b).reshape(m, n)
            single = torch.cat([cpu_kernels.bf16_linear(others[j : j + 1], w, b) for j in range(m)])
            assert torch.equal(bits(y3), bits(single))


@pytest.mark.parametrize("n,k", SHAPES + [(1030, 1536)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_f32_linear_is_accurate_and_batch_invariant(n, k, with_bias):
    """The fp32 kernel: within the fp32 accumulation bound of float64, and each row bitwise the same
    alone, among other rows of any count and scale, and in panels (M > 96)."""
    gen = torch.Generator().manual_seed(7 * n + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(200, k, generator=gen) * torch.rand(200, 1, generator=gen) * 10
    y = cpu_kernels.f32_linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    assert y.dtype == torch.float32 and y.shape == (200, n)
    assert ((y.double() - ref).abs() <= (k + 9) * 2.0**-24 * mag + 1e-30).all()
    for m in (1, 2, 3, 16, 64, 97):
        assert torch.equal(cpu_kernels.f32_linear(x[:m], w, b), y[:m]), m
        assert torch.equal(cpu_kernels.f32_linear(x[m - 1:m], w, b), y[m - 1:m]), m


def test_batch_invariant_mode_picks_the_kernels(monkeypatch):
    """On (the default): our kernels for bf16 and fp32 linears and the attention; off: torch's fp32
    GEMM and SDPA, bf16 by timing; the environment still overrides."""
    monkeypatch.delenv("MCSD_CPU_KERNELS", raising=False)
    monkeypatch.delenv("MCSD_INVARIANT_ATTENTION", raising=False)
    w = torch.zeros(32, 64)
    try:
        cpu_kernels.set_batch_invariant(True)
        assert cpu_kernels.batch_invariant() and cpu_kernels.should_use(w) and cpu_kernels.should_use(w.bfloat16())
        cpu_kernels.set_batch_invariant(False)
        assert not cpu_kernels.batch_invariant() and not cpu_kernels.should_use(w)
        assert not cpu_kernels._invariant_attention()
        monkeypatch.setenv("MCSD_INVARIANT_ATTENTION", "1")
        cpu_kernels._invariant_attention_decision.cache_clear()
        assert cpu_kernels._invariant_attention()
        cpu_kernels.set_batch_invariant(True)
        monkeypatch.setenv("MCSD_CPU_KERNELS", "0")
        cpu_kernels._enabled.cache_clear(), cpu_kernels._f32_enabled.cache_clear()
        assert not cpu_kernels.should_use(w) and not cpu_kernels.batch_invariant()
    finally:
        monkeypatch.delenv("MCSD_CPU_KERNELS", raising=False)
        monkeypatch.delenv("MCSD_INVARIANT_ATTENTION", raising=False)
        cpu_kernels.set_batch_invariant(True)
        for decision in (cpu_kernels._enabled, cpu_kernels._f32_enabled, cpu_kernels._invariant_attention_decision):
            decision.cache_clear()


@pytest.mark.parametrize("m", [96, 97, 200])
def test_long_inputs_in_panels(m):
    # more rows than one pass over the weights takes (prefill): same bits as row by row
    gen = torch.Generator().manual_seed(m)
    n, k = 1030, 1000
    w = bf16_randn(n, k, gen=gen)
    b = bf16_randn(n, gen=gen)
    x = bf16_randn(m, k, gen=gen)
    y = cpu_kernels.bf16_linear(x, w, b)
    single = torch.cat([cpu_kernels.bf16_linear(x[i : i + 1], w, b) for i in range(m)])
    assert torch.equal(bits(y), bits(single))
    ref, tol, _ = reference_bound(x, w, b)
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("m", [1, 2, 16, 33])
def test_thread_count_bitwise(m, restore_threads):
    gen = torch.Generator().manual_seed(m)
    # Enough weight rows that the work is split over the threads, and enough outputs that a
    # thread-dependent fp32 rounding would show through the bf16 rounding of the output.
    n, k = 4099, 1537
    w = bf16_randn(n, k, gen=gen)
    b = bf16_randn(n, gen=gen)
    x = bf16_randn(m, k, gen=gen)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(bits(cpu_kernels.bf16_linear(x, w, b)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_should_use_and_env_override(monkeypatch):
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    try:
        monkeypatch.setenv("MCSD_CPU_KERNELS", "0")
        cpu_kernels._enabled.cache_clear()
        assert not cpu_kernels.should_use(w)
        monkeypatch.setenv("MCSD_CPU_KERNELS", "1")
        cpu_kernels._enabled.cache_clear()
        assert cpu_kernels.should_use(w)
        # never for weights the kernels do not take
        assert not cpu_kernels.should_use(w.half())
        assert not cpu_kernels.should_use(w.t())
        assert not cpu_kernels.should_use(w[0])
        x = torch.ones(3, 64, dtype=torch.bfloat16)
        assert torch.equal(cpu_kernels.linear(x, w), cpu_kernels.bf16_linear(x, w))
        assert cpu_kernels.linear(x.float(), w.float()).dtype == torch.float32
        # unset: the timing decides, and it is a boolean made once
        monkeypatch.delenv("MCSD_CPU_KERNELS")
        cpu_kernels._enabled.cache_clear()
        decision = cpu_kernels.should_use(w)
        assert isinstance(decision, bool) and cpu_kernels.should_use(w) == decision
    finally:
        cpu_kernels._enabled.cache_clear()


def test_second_process_reuses_the_build():
    # The extension was built (or loaded) by this process; a new one must not compile again.
    code = "from engine.models import cpu_kernels as c; import sys; sys.exit(0 if c.available() else 1)"
    root = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "compiling" not in proc.stderr and proc.stdout == ""
