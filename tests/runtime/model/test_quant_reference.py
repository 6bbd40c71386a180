"""The torch reference GEMMs of the quantized layouts (``quant/reference.py``).

Each reference is held against math written independently here: the dense matmul of
``formats.dequantize`` (weight-only layouts: equal up to fp32 summation order), float64 exact
integer products (int8 W8A8), and a per-element bound on the activation quantization error
(W8A8: the only difference from the dense product).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve_runtime.ops.torch_backend import TorchOps
from splitserve_runtime.quant import reference
from splitserve_runtime.quant.formats import (
    FP8_DTYPE,
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    LinearWeight,
    dequantize,
    pack_int4,
)
from splitserve_runtime.quant.reference import (
    fp8_linear,
    int4_linear,
    int8_linear,
    quant_linear,
    quantize_per_token_fp8,
    quantize_per_token_int8,
)

SHAPES = [(1, 64, 96), (7, 96, 128), (33, 256, 64), (64, 128, 256)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weight(n: int, k: int, seed: int) -> Fp8Weight:
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    scale = w.abs().amax(dim=1) / 448.0
    return Fp8Weight(qweight=(w / scale[:, None]).to(FP8_DTYPE), weight_scale=scale)


def int8_weight(n: int, k: int, seed: int, *, act_quant: bool) -> Int8Weight:
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(qweight=q, weight_scale=scale, act_quant=act_quant)


def int4_weight(n: int, k: int, group: int, seed: int, dtype: torch.dtype) -> Int4Weight:
    gen = _gen(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand((k // group, n), generator=gen) * 0.02 + 0.001).to(dtype)
    offsets = (torch.randn((k // group, n), generator=gen) * 0.05).to(dtype)  # nonzero
    return Int4Weight(qweight=pack_int4(q), scales=scales, offsets=offsets, group_size=group)


def activations(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn((m, k), generator=_gen(seed)) * 2).to(dtype)


# ------------------------------------------------------------------ activation quantization
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activation_quant_error_is_bounded(dtype: torch.dtype) -> None:
    x = activations(33, 256, 0, dtype)
    x[3] = 0.0  # an all-zero row stays finite and quantizes to zeros
    xq, scale = quantize_per_token_fp8(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (33, 1) and torch.isfinite(scale).all()
    assert (xq[3].float() == 0).all()
    xf = x.float()
    # Each row's largest magnitude lands exactly on the e4m3 maximum.
    nonzero = torch.arange(33) != 3
    assert (xq.float().abs().amax(dim=1)[nonzero] == 448.0).all()
    # e4m3: 3 mantissa bits (half-ulp relative error 2^-4), subnormal step 2^-9 below 2^-6.
    err = (xq.float() * scale - xf).abs()
    bound = xf.abs() * 2.0**-4 + scale * 2.0**-10
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0  # it really quantizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_activation_quant_error_is_bounded(dtype: torch.dtype) -> None:
    x = activations(7, 96, 1, dtype)
    xq, scale = quantize_per_token_int8(x)
    assert xq.dtype == torch.int8 and scale.shape == (7, 1)
    assert (xq.abs().amax(dim=1) == 127).all()
    err = (xq.float() * scale - x.float()).abs()
    assert (err <= scale * 0.5 * (1 + 1e-5)).all() and err.max() > 0


def test_int8_activation_quant_rounds_half_to_even() -> None:
    x = torch.tensor([[127.0, 2.5, 3.5, -0.5, -1.5, 0.49]])  # amax 127 -> scale exactly 1
    xq, scale = quantize_per_token_int8(x)
    assert float(scale) == 1.0
    assert xq.tolist() == [[127, 2, 4, 0, -2, 0]]


# ------------------------------------------------------------------ W8A8
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reference_matches_dense_math_within_activation_quant_error(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
) -> None:
    x = activations(m, k, 2, dtype)
    w = fp8_weight(n, k, 3)
    bias = torch.randn(n, generator=_gen(4)).to(dtype)
    out = fp8_linear(x, w, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    dense_w = dequantize(w, dtype=torch.float64)
    xd = x.double()
    exact = xd @ dense_w.T + bias.double()
    # |x - fp8(x)| per element (test above), carried through |W|; plus the output rounding.
    _, scale = quantize_per_token_fp8(x)
    quant_err = (xd.abs() * 2.0**-4 + scale.double() * 2.0**-10) @ dense_w.abs().T
    out_round = exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 1e-6)
    err = (out.double() - exact).abs()
    assert (err <= quant_err + out_round + 1e-5).all()
    assert err.max() > 1e-4  # the activation quantization is visible, as on the GPU


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_w8a8_reference_is_exact_integer_gemm(m: int, k: int, n: int) -> None:
    x = activations(m, k, 5, torch.float32)
    w = int8_weight(n, k, 6, act_quant=True)
    bias = torch.randn(n, generator=_gen(7))
    xq, scale = quantize_per_token_int8(x)
    acc = (xq.double() @ w.qweight.double().T).float()  # exact, then fp32 as the kernel does
    expected = acc * scale * w.weight_scale + bias
    torch.testing.assert_close(int8_linear(x, w, bias), expected, rtol=0, atol=0)
    # and within the activation quantization error of the dense product
    dense_w = dequantize(w, dtype=torch.float64)
    err = (int8_linear(x, w, None).double() - x.double() @ dense_w.T).abs()
    assert (err <= scale.double() * 0.5 * dense_w.abs().sum(dim=1) + 1e-5).all()


def test_int8_float64_fallback_matches_int_mm() -> None:
    xq = torch.randint(-127, 128, (33, 200), generator=_gen(8), dtype=torch.int8)
    wq = torch.randint(-127, 128, (40, 200), generator=_gen(9), dtype=torch.int8)
    exact = torch._int_mm(xq, wq.t()).float()
    assert torch.equal(reference._int8_matmul_f64(xq, wq), exact)


# ------------------------------------------------------------------ weight-only
@pytest.mark.parametrize("m,k,n", SHAPES + [(0, 64, 96)])
def test_w8a16_reference_equals_dense_matmul(m: int, k: int, n: int) -> None:
    x = activations(m, k, 10, torch.float32)
    w = int8_weight(n, k, 11, act_quant=False)
    bias = torch.randn(n, generator=_gen(12))
    expected = F.linear(x, dequantize(w), bias)
    torch.testing.assert_close(int8_linear(x, w, bias), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,k,n", [(1, 128, 96), (7, 256, 64), (33, 128, 256), (0, 128, 8)])
def test_w4a16_reference_equals_dense_matmul(group: int, m: int, k: int, n: int) -> None:
    x = activations(m, k, 13, torch.float32)
    w = int4_weight(n, k, group, 14, torch.float32)
    bias = torch.randn(n, generator=_gen(15))
    expected = F.linear(x, dequantize(w), bias)
    torch.testing.assert_close(int4_linear(x, w, bias), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_only_reference_computes_in_fp32_and_rounds_once(dtype: torch.dtype) -> None:
    x = activations(7, 128, 16, dtype)
    one_ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # fp32 order may flip a rounding
    for w in (int4_weight(96, 128, 64, 17, dtype), int8_weight(96, 128, 18, act_quant=False)):
        out = quant_linear(x, w, None)
        expected = (x.float() @ dequantize(w).T).to(dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, rtol=one_ulp, atol=1e-6)


def test_dequantization_in_slabs_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    x = activations(5, 128, 19, torch.float32)
    weights: list[LinearWeight] = [
        int4_weight(100, 128, 32, 20, torch.float32),
        fp8_weight(100, 128, 21),
        int8_weight(100, 128, 22, act_quant=False),
        int8_weight(100, 128, 23, act_quant=True),
    ]
    whole = [quant_linear(x, w, None) for w in weights]
    monkeypatch.setattr(reference, "DEQUANT_CHUNK_ELEMENTS", 128 * 7)  # 7 rows per slab
    for w, expected in zip(weights, whole, strict=True):
        torch.testing.assert_close(quant_linear(x, w, None), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ dispatch and checks
def test_quant_linear_dispatches_on_layout() -> None:
    x = activations(3, 64, 24, torch.float32)
    dense = torch.randn((32, 64), generator=_gen(25))
    torch.testing.assert_close(quant_linear(x, dense, None), F.linear(x, dense))
    w8, i8 = fp8_weight(32, 64, 26), int8_weight(32, 64, 27, act_quant=True)
    i4 = int4_weight(32, 64, 32, 28, torch.float32)
    ops = TorchOps()
    for w, expected in ((w8, fp8_linear(x, w8, None)), (i8, int8_linear(x, i8, None)), (i4, int4_linear(x, i4, None))):
        assert torch.equal(quant_linear(x, w, None), expected)
        assert torch.equal(ops.linear(x, w, None), expected)
    assert torch.equal(ops.linear(x, dense, None), F.linear(x, dense))


def test_reference_rejects_bad_inputs() -> None:
    w = fp8_weight(32, 64, 29)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(3, 65), w, None)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fp8_linear(torch.randn(2, 3, 64), w, None)
    with pytest.raises(ValueError, match="bias"):
        int4_linear(torch.randn(3, 64), int4_weight(32, 64, 32, 30, torch.float32), torch.zeros(31))
    with pytest.raises(ValueError, match="unsupported"):
        quant_linear(torch.randn(3, 64), "weight", None)  # type: ignore[arg-type]
