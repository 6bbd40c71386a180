"""The torch kernel backend against naive, obviously-correct references (and HF for RoPE)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from splitserve_contract.model_config import RopeScaling
from splitserve_runtime.model.rope import build_cos_sin_cache
from splitserve_runtime.ops import get_ops
from splitserve_runtime.ops.interface import AttentionMetadata
from splitserve_runtime.ops.torch_backend import TorchOps

OPS = TorchOps()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_and_fused_add_match_reference() -> None:
    x = torch.randn(7, 32, generator=_gen(0))
    residual = torch.randn(7, 32, generator=_gen(1))
    weight = torch.randn(32, generator=_gen(2))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-5), expected)
    normed, summed = OPS.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, OPS.rms_norm(x + residual, weight, 1e-5))


def test_rms_norm_bf16_accumulates_in_fp32() -> None:
    x = (torch.randn(4, 256, generator=_gen(3)) * 50).to(torch.bfloat16)
    weight = torch.ones(256, dtype=torch.bfloat16)
    got = OPS.rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16
    reference = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=1e-2)


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 24, generator=_gen(4))
    gate, up = x[:, :24], x[:, 24:]
    torch.testing.assert_close(OPS.silu_and_mul(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_hf_llama(rope_scaling: dict[str, object] | None) -> None:
    head_dim, max_pos = 16, 256
    rope_parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": 10000.0}
    hf_config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )
    ours_scaling = None
    if rope_scaling is not None:
        fields = {k: v for k, v in rope_scaling.items() if k != "rope_type"}
        ours_scaling = RopeScaling(rope_type=str(rope_scaling["rope_type"]), **fields)  # type: ignore[arg-type]
    cache = build_cos_sin_cache(
        head_dim=head_dim,
        max_positions=max_pos,
        rope_theta=10000.0,
        rope_scaling=ours_scaling,
        device=torch.device("cpu"),
    )
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q = torch.randn(len(positions), 4, head_dim, generator=_gen(5))
    k = torch.randn(len(positions), 2, head_dim, generator=_gen(6))
    got_q, got_k = OPS.rotary_embedding(positions, q, k, cache)
    cos, sin = LlamaRotaryEmbedding(config=hf_config)(q, positions[None])
    # HF layout: [batch, heads, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    if rope_scaling is not None:
        plain = build_cos_sin_cache(
            head_dim=head_dim,
            max_positions=max_pos,
            rope_theta=10000.0,
            rope_scaling=None,
            device=torch.device("cpu"),
        )
        assert (plain - cache).abs().max() > 1e-2, "scaling must change the table"


def test_write_kv_cache_skips_negative_slots() -> None:
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key = torch.randn(3, 2, 8, generator=_gen(7))
    value = torch.randn(3, 2, 8, generator=_gen(8))
    OPS.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # exactly two slots written


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """q [Lq, H, D] at positions start_pos.., k/v [Lk, Hkv, D]; loops, no SDPA."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        visible = start_pos + i + 1
        for h in range(q.shape[1]):
            scores = (k[:visible, h // group] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, h // group]
    return out


def _paged(
    *,
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[list[int]]]:
    """Fill a cache for sequences (context_len, q_len); blocks handed out in reverse order."""
    num_blocks = sum(math.ceil(c / block_size) for c, _ in seqs) + 2
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks - 1, -1, -1))
    ks, vs, tables = [], [], []
    for i, (context_len, _) in enumerate(seqs):
        blocks = [free.pop(0) for _ in range(math.ceil(context_len / block_size))]
        k = torch.randn(context_len, num_kv_heads, head_dim, generator=_gen(seed + 2 * i))
        v = torch.randn(context_len, num_kv_heads, head_dim, generator=_gen(seed + 2 * i + 1))
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(context_len)])
        OPS.write_kv_cache(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, ks, vs, table, tables


def _metadata(
    *,
    prefill: list[tuple[int, int]],
    prefill_table: torch.Tensor,
    decode_lens: list[int],
    decode_table: torch.Tensor,
    block_size: int,
) -> AttentionMetadata:
    cu = [0]
    for _, q_len in prefill:
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_prefills=len(prefill),
        num_prefill_tokens=cu[-1],
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        prefill_context_lens=torch.tensor([c for c, _ in prefill], dtype=torch.int32),
        prefill_block_tables=prefill_table,
        prefill_max_q_len=max([q for _, q in prefill] + [0]),
        prefill_max_context_len=max([c for c, _ in prefill] + [0]),
        num_decodes=len(decode_lens),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
        decode_block_tables=decode_table,
        decode_max_context_len=max(decode_lens + [0]),
        block_size=block_size,
    )


@pytest.mark.parametrize(
    "seqs",
    [
        [(9, 9), (13, 5), (1, 1), (20, 3)],  # (context_len, q_len): fresh, prefix hits, ...
        [(9, 9), (1, 1), (14, 14)],  # no cached prefix: the causal fast path, ragged
    ],
)
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_prefill_attention_with_prefix_and_gqa_matches_naive(
    num_kv_heads: int,
    seqs: list[tuple[int, int]],
) -> None:
    block_size, heads, head_dim, scale = 4, 4, 8, 0.3
    k_cache, v_cache, ks, vs, table, _ = _paged(
        seqs=seqs,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=10,
    )
    q = torch.randn(sum(q for _, q in seqs), heads, head_dim, generator=_gen(9))
    md = _metadata(prefill=seqs, prefill_table=table, decode_lens=[], decode_table=table[:0], block_size=block_size)
    got = OPS.prefill_attention(q, k_cache, v_cache, md, scale)
    row = 0
    for (context_len, q_len), k, v in zip(seqs, ks, vs, strict=True):
        expected = _naive_attention(q[row : row + q_len], k, v, context_len - q_len, scale)
        torch.testing.assert_close(got[row : row + q_len], expected, atol=1e-5, rtol=1e-5)
        row += q_len


def test_decode_attention_batched_matches_naive() -> None:
    block_size, heads, num_kv_heads, head_dim, scale = 4, 8, 2, 16, 0.25
    lens = [1, 7, 16, 33]
    k_cache, v_cache, ks, vs, table, _ = _paged(
        seqs=[(n, 1) for n in lens],
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=20,
    )
    q = torch.randn(len(lens), heads, head_dim, generator=_gen(19))
    md = _metadata(prefill=[], prefill_table=table[:0], decode_lens=lens, decode_table=table, block_size=block_size)
    got = OPS.decode_attention(q, k_cache, v_cache, md, scale)
    for b, (n, k, v) in enumerate(zip(lens, ks, vs, strict=True)):
        expected = _naive_attention(q[b : b + 1], k, v, n - 1, scale)
        torch.testing.assert_close(got[b : b + 1], expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_bf16_close_to_fp32() -> None:
    block_size, lens = 16, [40, 5]
    k_cache, v_cache, _, _, table, _ = _paged(
        seqs=[(n, 1) for n in lens],
        block_size=block_size,
        num_kv_heads=2,
        head_dim=32,
        seed=30,
    )
    q = torch.randn(2, 4, 32, generator=_gen(29))
    md = _metadata(prefill=[], prefill_table=table[:0], decode_lens=lens, decode_table=table, block_size=block_size)
    fp32 = OPS.decode_attention(q, k_cache, v_cache, md, 0.2)
    bf16 = OPS.decode_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), md, 0.2)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, atol=3e-2, rtol=3e-2)


def test_get_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_ops(name="triton", device=cpu)
    assert get_ops(name="torch", device=cpu).name == "torch"
    assert get_ops(name="auto", device=cpu).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*auto, torch, triton"):
        get_ops(name="flash", device=cpu)
