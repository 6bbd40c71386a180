"""KV-cache scatter by slot_mapping: written slots, skipped padding, strided inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE

from splitserve_runtime.kernels.kv_cache_write import write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_scatters_and_skips_negative_slots(dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 4, 16, 2, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
    # Key/value as strided slices of one fused [T, 3, Hkv, D] buffer (like a QKV projection).
    fused = torch.randn((6, 3, num_kv_heads, head_dim), device=DEVICE).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    assert not key.is_contiguous()
    # Slots: last of a block, first of the next, padding, a high block, padding, offset 5.
    slots = torch.tensor([15, 16, -1, 3 * 16 + 9, -1, 5], dtype=torch.int64, device=DEVICE)
    write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

    expect_k = torch.zeros(shape, dtype=dtype, device=DEVICE)
    expect_v = torch.zeros(shape, dtype=dtype, device=DEVICE)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[i]
            expect_v[slot // block_size, slot % block_size] = value[i]
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 4  # exactly 4 slots written


def test_write_kv_cache_int32_slots_and_empty() -> None:
    k_cache = torch.zeros((2, 4, 1, 16), device=DEVICE)
    v_cache = torch.zeros((2, 4, 1, 16), device=DEVICE)
    key = torch.randn((2, 1, 16), device=DEVICE)
    value = torch.randn((2, 1, 16), device=DEVICE)
    write_kv_cache(
        key=key,
        value=value,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.tensor([7, 0], dtype=torch.int32, device=DEVICE),
    )
    assert torch.equal(k_cache[1, 3], key[0]) and torch.equal(v_cache[0, 0], value[1])
    empty = torch.empty((0, 1, 16), device=DEVICE)
    write_kv_cache(
        key=empty,
        value=empty,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.empty((0,), dtype=torch.int64, device=DEVICE),
    )


def test_write_kv_cache_rejects_bad_shapes() -> None:
    k_cache = torch.zeros((2, 4, 2, 16), device=DEVICE)
    key = torch.randn((3, 1, 16), device=DEVICE)
    with pytest.raises(ValueError, match="heads"):
        write_kv_cache(
            key=key,
            value=key,
            k_cache=k_cache,
            v_cache=k_cache.clone(),
            slot_mapping=torch.zeros(3, dtype=torch.int64, device=DEVICE),
        )
    key = torch.randn((3, 2, 16), device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(
            key=key,
            value=key,
            k_cache=k_cache,
            v_cache=k_cache.clone(),
            slot_mapping=torch.zeros(2, dtype=torch.int64, device=DEVICE),
        )
    with pytest.raises(ValueError, match="dtype"):
        write_kv_cache(
            key=key,
            value=key,
            k_cache=k_cache,
            v_cache=k_cache.clone(),
            slot_mapping=torch.zeros(3, dtype=torch.float32, device=DEVICE),
        )
