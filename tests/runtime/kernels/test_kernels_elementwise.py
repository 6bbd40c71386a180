"""RMSNorm (plain and fused with the residual add), neox RoPE and SiLU-and-mul."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, Tol, assert_close

from splitserve_runtime.kernels.activation import silu_and_mul
from splitserve_runtime.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from splitserve_runtime.kernels.rotary import rotary_embedding

DTYPES = [torch.float32, torch.bfloat16]
# fp32: reduction order only. bf16: one rounding of the output (2^-8 relative) plus the
# input-dtype rounding of the intermediate that HF also performs.
TOL = {torch.float32: Tol(atol=1e-5, rtol=1e-5), torch.bfloat16: Tol(atol=2e-2, rtol=1.6e-2)}


def _ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return normed * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 100), (2, 3, 64), (1, 1)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    w = torch.rand(shape[-1], device=DEVICE).to(dtype) + 0.5
    out = rms_norm(x=x, weight=w, eps=1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out.double(), _ref_rms_norm(x, w, 1e-6), tol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    x = torch.randn((5, 96), device=DEVICE).to(dtype)
    residual = torch.randn((5, 96), device=DEVICE).to(dtype)
    x_before, r_before = x.clone(), residual.clone()
    w = torch.rand(96, device=DEVICE).to(dtype) + 0.5
    out, new_residual = fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-5)
    summed = x + residual  # one add in the input dtype, like the kernel
    # Exact in fp32; in bf16 one ulp (2^-7 relative): the CPU interpreter truncates on
    # fp32 -> bf16 casts where the GPU rounds to nearest.
    ulp = Tol(atol=0.0, rtol=2**-7 if dtype == torch.bfloat16 else 0.0)
    assert_close(new_residual, summed, tol=ulp)
    assert_close(out.double(), _ref_rms_norm(summed, w, 1e-5), tol=TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # out-of-place


def test_rms_norm_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x=torch.randn(2, 8, device=DEVICE), weight=torch.ones(4, device=DEVICE), eps=1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x=torch.randn(2, 8, device=DEVICE), weight=torch.ones(8, device=DEVICE), eps=0.0)


def _cos_sin_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).double(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(DEVICE)


def _ref_rope(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = cache[positions.long()].double().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    rotated = torch.cat((-x2, x1), dim=-1)  # HF rotate_half
    return x.double() * torch.cat((cos, cos), -1) + rotated * torch.cat((sin, sin), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 1), (128, 6, 2)])
def test_rotary_embedding(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    cache = _cos_sin_cache(64, head_dim)
    positions = torch.tensor([0, 5, 63, 17, 17], device=DEVICE)
    # q and k as strided views of one fused projection output.
    fused = torch.randn((5, num_heads + 2 * num_kv_heads, head_dim), device=DEVICE).to(dtype)
    q, k = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = rotary_embedding(positions=positions, q=q, k=k, cos_sin_cache=cache)
    assert_close(q_out.double(), _ref_rope(q, positions, cache), tol=TOL[dtype])
    assert_close(k_out.double(), _ref_rope(k, positions, cache), tol=TOL[dtype])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity

    q2, k2 = rotary_embedding(positions=positions, q=q, k=k, cos_sin_cache=cache, inplace=True)
    assert q2.data_ptr() == q.data_ptr() and torch.equal(q, q_out) and torch.equal(k, k_out)


def test_rotary_rejects_wrong_cache_width() -> None:
    q = torch.randn((2, 2, 64), device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(
            positions=torch.zeros(2, dtype=torch.int64, device=DEVICE),
            q=q,
            k=q,
            cos_sin_cache=torch.zeros((8, 32), device=DEVICE),
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 600), (2, 2, 2 * 1100)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # 1100 > the 1024-column tile: exercises the column-block grid and its tail mask.
    x = (torch.randn(shape, device=DEVICE) * 4).to(dtype)
    out = silu_and_mul(x=x)
    half = shape[-1] // 2
    gate, up = x[..., :half].double(), x[..., half:].double()
    assert out.shape == (*shape[:-1], half) and out.dtype == dtype
    assert_close(out.double(), gate * torch.sigmoid(gate) * up, tol=TOL[dtype])


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(x=torch.randn((2, 7), device=DEVICE))
