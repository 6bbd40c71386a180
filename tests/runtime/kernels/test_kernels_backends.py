"""The Triton backend against the torch backend on one random mixed prefill + decode step."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_refs import DEVICE, Tol, assert_close

from splitserve_runtime.ops import get_ops
from splitserve_runtime.ops.interface import AttentionMetadata, Ops
from splitserve_runtime.ops.torch_backend import TorchOps
from splitserve_runtime.ops.triton_backend import TritonOps

BLOCK_SIZE = 16


def _random_step(
    *,
    prefills: list[tuple[int, int]],
    decode_contexts: list[int],
    num_blocks: int,
    seed: int,
) -> tuple[AttentionMetadata, int]:
    """Metadata for prefill (q_len, context_len) pairs then decode contexts; blocks shuffled.

    The flattened step gets two padding rows (slot -1) at its end. Returns (md, num_tokens).
    """
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    contexts = [ctx for _, ctx in prefills] + decode_contexts
    q_lens = [q for q, _ in prefills] + [1] * len(decode_contexts)
    max_blocks = max(math.ceil(c / BLOCK_SIZE) for c in contexts) + 1
    tables = torch.zeros((len(contexts), max_blocks), dtype=torch.int32)
    slots: list[int] = []
    for b, (ctx, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        blocks = [free.pop() for _ in range(math.ceil(ctx / BLOCK_SIZE))]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(ctx - q_len, ctx):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots += [-1, -1]
    n_pre = len(prefills)
    cu = [0]
    for q_len, _ in prefills:
        cu.append(cu[-1] + q_len)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        num_prefills=n_pre,
        num_prefill_tokens=cu[-1],
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        prefill_context_lens=torch.tensor(contexts[:n_pre], dtype=torch.int32, device=DEVICE),
        prefill_block_tables=tables[:n_pre].contiguous().to(DEVICE),
        prefill_max_q_len=max(q for q, _ in prefills),
        prefill_max_context_len=max(contexts[:n_pre]),
        num_decodes=len(decode_contexts),
        decode_context_lens=torch.tensor(decode_contexts, dtype=torch.int32, device=DEVICE),
        decode_block_tables=tables[n_pre:].contiguous().to(DEVICE),
        decode_max_context_len=max(decode_contexts),
        block_size=BLOCK_SIZE,
    )
    return md, len(slots)


def _step(
    ops: Ops, *, md: AttentionMetadata, qkv: torch.Tensor, caches: list[torch.Tensor], num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = caches
    q = qkv[:, :num_heads]
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    ops.write_kv_cache(key, value, k_cache, v_cache, md.slot_mapping)
    scale = q.shape[-1] ** -0.5
    n_pre = md.num_prefill_tokens
    pre = ops.prefill_attention(q[:n_pre], k_cache, v_cache, md, scale)
    dec = ops.decode_attention(q[n_pre : n_pre + md.num_decodes], k_cache, v_cache, md, scale)
    return pre, dec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_backend(dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim, num_blocks = 8, 2, 64, 24
    md, num_tokens = _random_step(
        prefills=[(17, 17), (5, 37), (1, 16)], decode_contexts=[1, 33, 48, 80], num_blocks=num_blocks, seed=1
    )
    gen = torch.Generator().manual_seed(2)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    cache0 = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    qkv = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    tol = Tol(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else Tol(atol=2e-2, rtol=2e-2)

    results = {}
    for ops in (TorchOps(), TritonOps()):
        caches = [c.clone() for c in cache0]
        results[ops.name] = (
            *_step(ops, md=md, qkv=qkv, caches=caches, num_heads=num_heads, num_kv_heads=num_kv_heads),
            *caches,
        )
    for name, ref, got in zip(
        ("prefill", "decode", "k_cache", "v_cache"), results["torch"], results["triton"], strict=True
    ):
        assert_close(got.float(), ref.float(), tol=tol, what=name)
    assert not torch.equal(results["triton"][2], cache0[0])  # the write happened

    torch_ops, triton_ops = TorchOps(), TritonOps()
    x = torch.randn((num_tokens, 96), generator=gen).to(dtype).to(DEVICE)
    res = torch.randn((num_tokens, 96), generator=gen).to(dtype).to(DEVICE)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype).to(DEVICE)
    assert_close(triton_ops.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), tol=tol)
    for got_t, ref_t in zip(
        triton_ops.fused_add_rms_norm(x, res, w, 1e-6), torch_ops.fused_add_rms_norm(x, res, w, 1e-6), strict=True
    ):
        assert_close(got_t, ref_t, tol=tol)
    positions = torch.randint(0, 128, (num_tokens,), generator=gen).to(DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    for got_t, ref_t in zip(
        triton_ops.rotary_embedding(positions, q, k, cos_sin),
        torch_ops.rotary_embedding(positions, q, k, cos_sin),
        strict=True,
    ):
        assert_close(got_t, ref_t, tol=tol)
    gate_up = torch.randn((num_tokens, 2 * 80), generator=gen).to(dtype).to(DEVICE)
    assert_close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), tol=tol)


def test_get_ops_returns_triton_backend() -> None:
    ops = get_ops(name="triton", device=DEVICE)
    assert isinstance(ops, TritonOps) and ops.name == "triton"


def test_empty_parts_return_empty() -> None:
    md, _ = _random_step(prefills=[(3, 3)], decode_contexts=[4], num_blocks=4, seed=0)
    md.num_decodes = 0
    ops = TritonOps()
    cache = torch.zeros((4, BLOCK_SIZE, 1, 64), device=DEVICE)
    out = ops.decode_attention(torch.empty((0, 2, 64), device=DEVICE), cache, cache, md, 0.1)
    assert out.shape == (0, 2, 64)
    with pytest.raises(ValueError, match="prefill tokens"):
        ops.prefill_attention(torch.empty((5, 2, 64), device=DEVICE), cache, cache, md, 0.1)
