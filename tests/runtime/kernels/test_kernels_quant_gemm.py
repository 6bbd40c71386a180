"""Quantized GEMM kernels (W8A8 fp8/int8, W8A16, W4A16) against the torch reference.

On CPU these run under ``TRITON_INTERPRET=1`` (conftest). Activation quantization is checked
bit for bit (the kernel divides with ``div_rn`` and rounds half to even like torch). GEMM
outputs are checked per element against ``quant/reference.py`` with a bound made of one
rounding of the output (the interpreter truncates fp32 -> bf16 where the GPU rounds), fp32
summation order relative to ``sum |x| |w|``, and, on the GPU only, the rounding of the
dequantized weight to the activation dtype before the tensor-core dot.
"""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE

from splitserve_runtime.kernels import act_quant
from splitserve_runtime.kernels._common import interpreting
from splitserve_runtime.kernels._gemm_common import GemmConfig
from splitserve_runtime.kernels.act_quant import quantize_per_token
from splitserve_runtime.kernels.scaled_gemm import scaled_gemm, w8a8_linear
from splitserve_runtime.kernels.w4a16_gemm import w4a16_linear
from splitserve_runtime.kernels.w8a16_gemm import w8a16_linear
from splitserve_runtime.ops.torch_backend import TorchOps
from splitserve_runtime.ops.triton_backend import TritonOps
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

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# GPU weight-only dots round the dequantized weight to the activation dtype.
OPERAND_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (M, K, N, with bias): ragged M, K tails (96 vs a 128-wide K tile), N not a tile multiple.
GEMM_SHAPES = [(1, 64, 96, True), (7, 96, 128, False), (33, 256, 64, True), (64, 128, 256, False)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def activations(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn((m, k), generator=_gen(seed)) * 2).to(dtype).to(DEVICE)


def fp8_weight(n: int, k: int, seed: int) -> Fp8Weight:
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    scale = w.abs().amax(dim=1) / 448.0
    return Fp8Weight(qweight=(w / scale[:, None]).to(FP8_DTYPE).to(DEVICE), weight_scale=scale.to(DEVICE))


def int8_weight(n: int, k: int, seed: int, *, act_quant: bool) -> Int8Weight:
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(qweight=q.to(DEVICE), weight_scale=scale.to(DEVICE), act_quant=act_quant)


def int4_weight(n: int, k: int, group: int, seed: int, dtype: torch.dtype) -> Int4Weight:
    gen = _gen(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand((k // group, n), generator=gen) * 0.02 + 0.001
    offsets = torch.randn((k // group, n), generator=gen) * 0.05
    return Int4Weight(
        qweight=pack_int4(q).to(DEVICE),
        scales=scales.to(dtype).to(DEVICE),
        offsets=offsets.to(dtype).to(DEVICE),
        group_size=group,
    )


def bias_for(n: int, dtype: torch.dtype, with_bias: bool) -> torch.Tensor | None:
    return torch.randn(n, generator=_gen(99)).to(dtype).to(DEVICE) if with_bias else None


def assert_gemm_close(
    out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, weight: LinearWeight, *, weight_only: bool
) -> float:
    """Per-element bound (module docstring); returns the max abs error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    dtype = x.dtype
    magnitude = x.float().abs() @ dequantize(weight).abs().T
    operand = OPERAND_ROUNDING[dtype] if weight_only and not interpreting() else 0.0
    bound = OUT_ULP[dtype] * ref.float().abs() + (2e-6 + operand) * magnitude + 1e-6
    err = (out.float() - ref.float()).abs()
    worst = float(err.max()) if err.numel() else 0.0
    excess = float((err - bound).max()) if err.numel() else 0.0
    assert (err <= bound).all(), f"max abs err {worst:.3g}, worst excess over bound {excess:.3g}"
    return worst


# ------------------------------------------------------------------ activation quantization
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("m,k", [(1, 64), (33, 96), (3, 5000)])  # 5000: two K chunks
def test_act_quant_is_bit_exact(dtype: torch.dtype, qdtype: torch.dtype, m: int, k: int) -> None:
    x = activations(m, k, 0, dtype)
    x[0, : k // 2] = 0.0
    if m > 2:
        x[2] = 0.0  # all-zero row: floor scale, zero codes
    q, scale = quantize_per_token(x=x, dtype=qdtype)
    if qdtype == FP8_DTYPE:
        ref_q, ref_scale = reference.quantize_per_token_fp8(x)
    else:
        ref_q, ref_scale = reference.quantize_per_token_int8(x)
    assert q.dtype == qdtype and scale.dtype == torch.float32 and scale.shape == (m,)
    assert torch.equal(scale, ref_scale[:, 0])
    assert torch.equal(q.float(), ref_q.float())


def test_act_quant_fp8_rounding_edge_cases() -> None:
    # amax 448 -> scale exactly 1: values go to e4m3 unchanged. Ties (17 -> 16, 19 -> 20),
    # mantissa carry into the exponent (31.6 -> 32, 126.3 -> 128), subnormals (3 * 2^-10 is
    # a tie between 2^-9 and 2^-8), saturation is by the amax, and a sign.
    values = [448.0, 17.0, 19.0, 31.6, -126.3, 3 * 2.0**-10, 2.0**-11, -0.0029296875, 240.1, -447.0, 0.0]
    x = torch.tensor([values], device=DEVICE)
    q, scale = quantize_per_token(x=x, dtype=FP8_DTYPE)
    assert float(scale[0]) == 1.0
    assert q.float().cpu().tolist() == x.cpu().to(FP8_DTYPE).float().tolist()
    assert q.float().cpu().tolist()[0][:5] == [448.0, 16.0, 20.0, 32.0, -128.0]


def test_act_quant_int8_rounds_half_to_even() -> None:
    x = torch.tensor([[127.0, 2.5, 3.5, -0.5, -1.5, 0.49, -126.5]], device=DEVICE)
    q, scale = quantize_per_token(x=x, dtype=torch.int8)
    assert float(scale[0]) == 1.0
    assert q.cpu().tolist() == [[127, 2, 4, 0, -2, 0, -126]]


def test_act_quant_floor_matches_reference() -> None:
    assert act_quant.ACT_AMAX_FLOOR == reference.ACT_AMAX_FLOOR


# ------------------------------------------------------------------ W8A8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m,k,n,with_bias", GEMM_SHAPES)
def test_w8a8_matches_reference(dtype: torch.dtype, kind: str, m: int, k: int, n: int, with_bias: bool) -> None:
    weight: Fp8Weight | Int8Weight = fp8_weight(n, k, 1) if kind == "fp8" else int8_weight(n, k, 1, act_quant=True)
    # rows of a wider tensor: the launcher honours the row stride
    x = torch.cat([activations(m, k, 2, dtype), activations(m, 8, 3, dtype)], dim=1)[:, :k]
    bias = bias_for(n, dtype, with_bias)
    out = w8a8_linear(x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=bias)
    assert_gemm_close(out, reference.quant_linear(x, weight, bias), x, weight, weight_only=False)


def test_w8a8_prefill_tiles_and_grouped_order() -> None:
    # M = 130 takes the 128 x 128 prefill tiles with GROUP_M = 8 (two row tiles).
    x = activations(130, 128, 4, torch.bfloat16)
    for weight in (fp8_weight(160, 128, 5), int8_weight(160, 128, 5, act_quant=True)):
        out = w8a8_linear(x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=None)
        assert_gemm_close(out, reference.quant_linear(x, weight, None), x, weight, weight_only=False)


@pytest.mark.parametrize("kind,fast_accum", [("fp8", False), ("fp8", True), ("int8", False)])
def test_scaled_gemm_explicit_config_swizzle_and_k_tail(kind: str, fast_accum: bool) -> None:
    # 3 x 4 tiles in groups of 2 row tiles (the last group is partial); K = 96 = 64 + a tail.
    weight = fp8_weight(64, 96, 6) if kind == "fp8" else int8_weight(64, 96, 6, act_quant=True)
    x = activations(33, 96, 7, torch.float32)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=64, group_m=2, num_warps=4, num_stages=2)
    out = w8a8_linear(
        x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=None, config=cfg, fast_accum=fast_accum
    )
    assert_gemm_close(out, reference.quant_linear(x, weight, None), x, weight, weight_only=False)


# ------------------------------------------------------------------ W8A16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n,with_bias", GEMM_SHAPES + [(130, 64, 160, True)])
def test_w8a16_matches_reference(dtype: torch.dtype, m: int, k: int, n: int, with_bias: bool) -> None:
    weight = int8_weight(n, k, 8, act_quant=False)
    x = activations(m, k, 9, dtype)
    bias = bias_for(n, dtype, with_bias)
    out = w8a16_linear(x=x, qweight=weight.qweight, weight_scale=weight.weight_scale, bias=bias)
    assert_gemm_close(out, reference.quant_linear(x, weight, bias), x, weight, weight_only=True)


# ------------------------------------------------------------------ W4A16
W4_CASES = [
    (1, 128, 96, 32, True),
    (7, 256, 64, 64, False),
    (33, 128, 128, 128, True),
    (64, 256, 96, 128, False),
    (130, 128, 64, 64, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n,group,with_bias", W4_CASES)
def test_w4a16_matches_reference(dtype: torch.dtype, m: int, k: int, n: int, group: int, with_bias: bool) -> None:
    weight = int4_weight(n, k, group, 10, dtype)
    x = activations(m, k, 11, dtype)
    bias = bias_for(n, dtype, with_bias)
    out = w4a16_linear(
        x=x,
        qweight=weight.qweight,
        scales=weight.scales,
        offsets=weight.offsets,
        group_size=weight.group_size,
        bias=bias,
    )
    assert_gemm_close(out, reference.quant_linear(x, weight, bias), x, weight, weight_only=True)


@pytest.mark.parametrize("block_k", [16, 64])
def test_w4a16_k_tile_spanning_groups_and_k_tail(block_k: int) -> None:
    # group 32 with a 64-wide K tile gathers scales per row; K = 96 leaves a masked tail.
    weight = int4_weight(48, 96, 32, 12, torch.float32)
    x = activations(7, 96, 13, torch.float32)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=block_k, group_m=2, num_warps=4, num_stages=2)
    out = w4a16_linear(
        x=x, qweight=weight.qweight, scales=weight.scales, offsets=weight.offsets, group_size=32, bias=None, config=cfg
    )
    assert_gemm_close(out, reference.quant_linear(x, weight, None), x, weight, weight_only=True)


# ------------------------------------------------------------------ backends, edges, checks
def test_triton_backend_linear_matches_torch_backend() -> None:
    x = activations(5, 128, 14, torch.bfloat16)
    dense = (torch.randn((64, 128), generator=_gen(15)) * 0.05).to(torch.bfloat16).to(DEVICE)
    bias = bias_for(64, torch.bfloat16, True)
    weights: list[LinearWeight] = [
        dense,
        fp8_weight(64, 128, 16),
        int8_weight(64, 128, 17, act_quant=True),
        int8_weight(64, 128, 18, act_quant=False),
        int4_weight(64, 128, 64, 19, torch.bfloat16),
    ]
    triton_ops, torch_ops = TritonOps(), TorchOps()
    for weight in weights:
        out = triton_ops.linear(x, weight, bias)
        ref = torch_ops.linear(x, weight, bias)
        dense_like = isinstance(weight, torch.Tensor)
        assert_gemm_close(
            out,
            ref,
            x,
            weight,
            weight_only=dense_like
            or isinstance(weight, Int4Weight)
            or (isinstance(weight, Int8Weight) and not weight.act_quant),
        )


def test_empty_batch_returns_empty_output() -> None:
    x = activations(0, 64, 20, torch.bfloat16)
    w8 = int8_weight(32, 64, 21, act_quant=True)
    w4 = int4_weight(32, 64, 32, 22, torch.bfloat16)
    for out in (
        w8a8_linear(x=x, qweight=w8.qweight, weight_scale=w8.weight_scale, bias=None),
        w8a16_linear(x=x, qweight=w8.qweight, weight_scale=w8.weight_scale, bias=None),
        w4a16_linear(x=x, qweight=w4.qweight, scales=w4.scales, offsets=w4.offsets, group_size=32, bias=None),
        quantize_per_token(x=x, dtype=FP8_DTYPE)[0],
    ):
        assert out.shape[0] == 0 and out.dtype in (torch.bfloat16, FP8_DTYPE)


def test_launchers_reject_bad_inputs() -> None:
    x = activations(3, 64, 23, torch.bfloat16)
    w8 = int8_weight(32, 64, 24, act_quant=True)
    w4 = int4_weight(32, 64, 32, 25, torch.bfloat16)
    fp8 = fp8_weight(32, 64, 26)
    with pytest.raises(ValueError, match="features"):
        w8a8_linear(x=x[:, :63], qweight=w8.qweight, weight_scale=w8.weight_scale, bias=None)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        w8a8_linear(x=x, qweight=w8.qweight.to(torch.int16), weight_scale=w8.weight_scale, bias=None)
    with pytest.raises(ValueError, match="bias must have 32"):
        w8a16_linear(
            x=x,
            qweight=w8.qweight,
            weight_scale=w8.weight_scale,
            bias=torch.zeros(31, dtype=torch.bfloat16, device=DEVICE),
        )
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        w8a16_linear(x=x[:, :32], qweight=w8.qweight[:, ::2], weight_scale=w8.weight_scale, bias=None)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        w4a16_linear(x=x[0], qweight=w4.qweight, scales=w4.scales, offsets=w4.offsets, group_size=32, bias=None)
    with pytest.raises(ValueError, match="group_size 24"):
        w4a16_linear(x=x, qweight=w4.qweight, scales=w4.scales, offsets=w4.offsets, group_size=24, bias=None)
    with pytest.raises(ValueError, match=r"scales must be \[2, 32\]"):
        w4a16_linear(x=x, qweight=w4.qweight, scales=w4.scales[:1], offsets=w4.offsets, group_size=32, bias=None)
    with pytest.raises(ValueError, match="a is"):
        xq, sx = quantize_per_token(x=x, dtype=torch.int8)
        scaled_gemm(a=xq, a_scale=sx, b=fp8.qweight, b_scale=fp8.weight_scale, bias=None, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be float8_e4m3fn or int8"):
        quantize_per_token(x=x, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        GemmConfig(block_m=24, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_k >= 32"):
        w8a8_linear(
            x=x,
            qweight=w8.qweight,
            weight_scale=w8.weight_scale,
            bias=None,
            config=GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2),
        )
