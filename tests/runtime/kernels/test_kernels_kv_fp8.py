"""FP8 (e4m3) KV cache in the Triton kernels: the write stores exactly torch's bytes, the
attention kernels read fp8 blocks with per-tensor scales, and the Triton backend agrees with
the torch backend (the CPU path) end to end.

Under ``TRITON_INTERPRET=1`` the write goes through the interpreter-only rounding shim of
``kernels/_fp8.py``; on a GPU the same tests check the real ``cvt.rn.satfinite`` path.
"""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, PagedKV, dense_attention, gather_seq, make_paged_kv

from splitserve_runtime.kernels.decode_attention import decode_attention
from splitserve_runtime.kernels.kv_cache_write import write_kv_cache
from splitserve_runtime.kernels.prefill_attention import prefill_attention
from splitserve_runtime.ops.interface import AttentionMetadata
from splitserve_runtime.ops.kv_fp8 import encode_kv
from splitserve_runtime.ops.torch_backend import TorchOps
from splitserve_runtime.ops.triton_backend import TritonOps

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.37, 2.5


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def _all_e4m3_values() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return values[values.isfinite()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_stores_torchs_bytes_with_scales_and_saturation(dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 2, 64
    gen = torch.Generator().manual_seed(3)
    num_tokens = 40
    # Magnitudes from 2^-14 (below the smallest subnormal once divided by the scale) to 2^10
    # (far past 448 * scale, so those saturate).
    exponents = torch.randint(-14, 11, (num_tokens, num_kv_heads, 1), generator=gen).float()
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen) * torch.exp2(exponents)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen) * 600.0
    key, value = key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[5] = -1  # padding: not written
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=FP8, device=DEVICE)
    write_kv_cache(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, k_scale=K_SCALE, v_scale=V_SCALE
    )

    keep = slots >= 0
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    expect_k = encode_kv(key[keep], cache_dtype=FP8, scale=K_SCALE)
    expect_v = encode_kv(value[keep], cache_dtype=FP8, scale=V_SCALE)
    assert torch.equal(_bytes(flat_k[slots[keep]]), _bytes(expect_k))
    assert torch.equal(_bytes(flat_v[slots[keep]]), _bytes(expect_v))
    # Saturation: values past 448 * scale are stored as ±448, never NaN.
    big = value[keep].float().abs() > 448 * V_SCALE
    assert int(big.sum()) > 100
    assert torch.equal(flat_v[slots[keep]].float().abs()[big].cpu(), torch.full((int(big.sum()),), 448.0))
    assert not flat_k.float().isnan().any() and not flat_v.float().isnan().any()
    # Nothing outside the written slots changed.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep].cpu()] = False
    assert int(_bytes(flat_k)[untouched].count_nonzero()) == 0


def test_write_rounds_to_nearest_even_like_torch() -> None:
    """Every e4m3 value, every midpoint between neighbours (ties) and points just off the
    midpoints, both signs: the stored byte equals torch's cast of the same value."""
    grid = torch.unique(_all_e4m3_values())
    mids = (grid[1:] + grid[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2**-12), mids * (1 - 2**-12)])
    x = torch.cat([grid, mids, nudged, torch.tensor([-0.0, 2**-12, 500.0, -1e6])])
    rows = -(-x.numel() // 64)
    x = torch.cat([x, torch.zeros(rows * 64 - x.numel())])  # 64 values per token row
    key = x.view(rows, 1, 64).to(DEVICE)
    cache = torch.zeros((rows, 1, 1, 64), dtype=FP8, device=DEVICE)
    write_kv_cache(
        key=key,
        value=key,
        k_cache=cache,
        v_cache=torch.zeros_like(cache),
        slot_mapping=torch.arange(rows, device=DEVICE),
    )
    stored = cache.flatten()
    mismatch = (_bytes(stored) != _bytes(x.clamp(-448, 448).to(FP8))).nonzero().flatten()
    assert mismatch.numel() == 0, f"{x[mismatch][:5].tolist()} -> {stored[mismatch[:5]].float().tolist()}"


def _fp8_paged_kv(
    context_lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int, seed: int
) -> tuple[PagedKV, PagedKV]:
    """An fp8 cache (K stored as k / K_SCALE, V as v / V_SCALE) and its dequantized fp32 twin."""
    base = make_paged_kv(
        context_lens=context_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=seed,
    )
    k8 = encode_kv(base.k_cache, cache_dtype=FP8, scale=K_SCALE)
    v8 = encode_kv(base.v_cache * 4.0, cache_dtype=FP8, scale=V_SCALE)
    fp8 = PagedKV(
        k_cache=k8, v_cache=v8, block_tables=base.block_tables, context_lens=base.context_lens, block_size=block_size
    )
    exact = PagedKV(
        k_cache=k8.float() * K_SCALE,
        v_cache=v8.float() * V_SCALE,
        block_tables=base.block_tables,
        context_lens=base.context_lens,
        block_size=block_size,
    )
    return fp8, exact


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_fp8_blocks_with_scales(q_dtype: torch.dtype) -> None:
    lens = [1, 17, 70, 33]
    fp8, exact = _fp8_paged_kv(lens, num_kv_heads=2, head_dim=64, block_size=16, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn((len(lens), 8, 64), generator=gen).to(q_dtype).to(DEVICE)
    out = decode_attention(
        q=q,
        k_cache=fp8.k_cache,
        v_cache=fp8.v_cache,
        block_tables=fp8.block_tables,
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        max_context_len=max(lens),
        scale=0.125,
        num_splits=2,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert out.dtype == q_dtype
    tol = 2e-5 if q_dtype == torch.float32 else 6e-2  # bf16: output rounding of |out| ~ 4
    for b, n in enumerate(lens):
        k, v = gather_seq(exact, b)
        ref = dense_attention(q=q[b : b + 1], k=k, v=v, q_positions=[n - 1], scale=0.125)
        torch.testing.assert_close(out[b : b + 1].double().cpu(), ref, atol=tol, rtol=tol)


def test_prefill_reads_fp8_blocks_with_scales_and_prefix() -> None:
    q_lens, lens = [5, 20, 33], [5, 37, 70]  # sequences 2 and 3 have a cached prefix
    fp8, exact = _fp8_paged_kv(lens, num_kv_heads=2, head_dim=64, block_size=16, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn((sum(q_lens), 4, 64), generator=gen).to(DEVICE)
    cu = torch.tensor([0, 5, 25, 58], dtype=torch.int32, device=DEVICE)
    out = prefill_attention(
        q=q,
        k_cache=fp8.k_cache,
        v_cache=fp8.v_cache,
        block_tables=fp8.block_tables,
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu,
        max_q_len=max(q_lens),
        max_context_len=max(lens),
        scale=0.125,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    for b, (q_len, n) in enumerate(zip(q_lens, lens, strict=True)):
        k, v = gather_seq(exact, b)
        rows = q[int(cu[b]) : int(cu[b + 1])]
        ref = dense_attention(q=rows, k=k, v=v, q_positions=list(range(n - q_len, n)), scale=0.125)
        torch.testing.assert_close(out[int(cu[b]) : int(cu[b + 1])].double().cpu(), ref, atol=2e-5, rtol=2e-5)


def test_scales_are_validated_and_kv_dtypes_must_match() -> None:
    lens = [4]
    fp8, _ = _fp8_paged_kv(lens, num_kv_heads=1, head_dim=16, block_size=4, seed=9)
    q = torch.randn((1, 1, 16), device=DEVICE)
    args = dict(
        q=q,
        k_cache=fp8.k_cache,
        v_cache=fp8.v_cache,
        block_tables=fp8.block_tables,
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        max_context_len=4,
        scale=0.25,
    )
    with pytest.raises(ValueError, match="k_scale must be a positive finite float"):
        decode_attention(**args, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        decode_attention(**args, v_scale=float("nan"))
    mixed = {**args, "v_cache": fp8.v_cache.float()}
    with pytest.raises(ValueError, match="k_cache is torch.float8_e4m3fn but v_cache is torch.float32"):
        decode_attention(**mixed)
    key = torch.randn((1, 1, 16), device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(
            key=key,
            value=key,
            k_cache=fp8.k_cache,
            v_cache=fp8.v_cache,
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=DEVICE),
            k_scale=-1.0,
        )


def _metadata(*, block_size: int) -> tuple[AttentionMetadata, list[int]]:
    """Two prefills (one extending a 6-token prefix) and two decodes over 12 blocks."""
    tables = [[3, 7, 1], [0, 5, 2], [9, 4], [11, 6, 8, 10]]
    prefill_q, prefill_ctx, decode_ctx = [6, 9], [6, 15], [7, 13]
    slots = []
    for table, q_len, ctx in zip(tables[:2], prefill_q, prefill_ctx, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    for table, ctx in zip(tables[2:], decode_ctx, strict=True):
        slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)

    def table_tensor(rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=DEVICE)

    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        num_prefills=2,
        num_prefill_tokens=sum(prefill_q),
        prefill_cu_seqlens_q=torch.tensor([0, 6, 15], dtype=torch.int32, device=DEVICE),
        prefill_context_lens=torch.tensor(prefill_ctx, dtype=torch.int32, device=DEVICE),
        prefill_block_tables=table_tensor(tables[:2]),
        prefill_max_q_len=9,
        prefill_max_context_len=15,
        num_decodes=2,
        decode_context_lens=torch.tensor(decode_ctx, dtype=torch.int32, device=DEVICE),
        decode_block_tables=table_tensor(tables[2:]),
        decode_max_context_len=13,
        block_size=block_size,
    )
    return md, slots


def test_triton_backend_matches_the_torch_backend_on_fp8_caches() -> None:
    block_size, num_kv_heads, head_dim = 8, 2, 32
    md, slots = _metadata(block_size=block_size)
    gen = torch.Generator().manual_seed(10)
    shape = (12, block_size, num_kv_heads, head_dim)
    # Both caches start from the same fp8 history (the prefix and the decode contexts).
    history = encode_kv(torch.randn(shape, generator=gen) * 2, cache_dtype=FP8, scale=K_SCALE)
    caches = {}
    num_tokens = len(slots)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(DEVICE)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(DEVICE) * 5
    q = torch.randn((num_tokens, 4, head_dim), generator=gen).to(DEVICE)
    outs = {}
    for ops in (TorchOps(), TritonOps()):
        k_cache, v_cache = history.clone().to(DEVICE), history.clone().to(DEVICE)
        ops.write_kv_cache(key, value, k_cache, v_cache, md.slot_mapping, k_scale=K_SCALE, v_scale=V_SCALE)
        caches[ops.name] = (k_cache, v_cache)
        pre = ops.prefill_attention(q[:15], k_cache, v_cache, md, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
        dec = ops.decode_attention(q[15:], k_cache, v_cache, md, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
        outs[ops.name] = torch.cat([pre, dec])
    for ref, got in zip(caches["torch"], caches["triton"], strict=True):
        assert torch.equal(_bytes(ref), _bytes(got))
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-5, rtol=2e-5)
    # The scales matter: reading with v_scale 1 gives a different answer.
    k_cache, v_cache = caches["triton"]
    unscaled = TritonOps().decode_attention(q[15:], k_cache, v_cache, md, 0.2, k_scale=K_SCALE)
    assert not torch.allclose(unscaled, outs["triton"][15:], atol=1e-2)
