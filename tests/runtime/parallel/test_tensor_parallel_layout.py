"""Which heads, rows and columns each tensor-parallel rank holds: every query head exactly once
and beside the KV head it reads, the shards of every checkpoint tensor putting the whole
tensor back together, and the sizes that cannot be split refused with the reason."""

from __future__ import annotations

import pytest
import torch

from splitserve_contract.model_config import ModelConfig
from splitserve_runtime.model.tensor_parallel import (
    TensorParallelError,
    TensorParallelLayout,
    check_divisible,
)


def _config(*, heads: int, kv: int, head_dim: int = 4, inter: int = 24, vocab: int = 50) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=True,
        sliding_window=None,
        eos_token_ids=(0,),
        bos_token_id=None,
        torch_dtype=None,
    )


SHAPES = [(8, 8, 2), (8, 2, 2), (9, 3, 2), (12, 3, 2), (8, 2, 4), (8, 2, 8), (8, 1, 4), (16, 4, 8), (4, 4, 1)]
"""(query heads, KV heads, ranks): even and uneven KV groups, and replicated KV heads."""


@pytest.mark.parametrize(("heads", "kv", "size"), SHAPES)
def test_query_heads_are_covered_once_next_to_their_kv_head(heads: int, kv: int, size: int) -> None:
    config = _config(heads=heads, kv=kv)
    group = heads // kv
    layouts = [TensorParallelLayout(config=config, rank=r, size=size) for r in range(size)]
    owned_q: list[int] = []
    for layout in layouts:
        q = range(layout.q_head_start(), layout.q_head_start() + layout.num_heads)
        kv_heads = range(layout.kv_head_start(), layout.kv_head_start() + layout.num_kv_heads)
        assert layout.num_heads >= 1 and layout.num_kv_heads >= 1
        assert {h // group for h in q} <= set(kv_heads)  # every local query head reads a local KV head
        local = layout.local_config()
        assert local.num_attention_heads % local.num_key_value_heads == 0
        owned_q.extend(q)
    assert sorted(owned_q) == list(range(heads))
    for head in range(kv):  # the rank a whole-model read takes each KV head from holds it
        owner = layouts[0].kv_head_owner(head)
        assert layouts[owner].kv_head_start() <= head < layouts[owner].kv_head_start() + layouts[owner].num_kv_heads


def test_uneven_groups_differ_by_at_most_one() -> None:
    config = _config(heads=9, kv=3)  # SmolLM2's heads
    counts = [TensorParallelLayout(config=config, rank=r, size=2).num_kv_heads for r in range(2)]
    assert sorted(counts) == [1, 2]


@pytest.mark.parametrize(
    ("heads", "kv", "size", "inter", "reason"),
    [
        (6, 2, 8, 24, "cannot be replicated evenly"),  # 4 ranks share a KV head but it has 3 query heads
        (6, 3, 4, 24, "cannot be replicated evenly"),  # 4 ranks over 3 KV heads
        (8, 8, 2, 25, "intermediate size 25"),
    ],
)
def test_sizes_that_cannot_split_are_refused(heads: int, kv: int, size: int, inter: int, reason: str) -> None:
    with pytest.raises(TensorParallelError, match=reason):
        check_divisible(_config(heads=heads, kv=kv, inter=inter), size)
    with pytest.raises(TensorParallelError, match=reason):
        TensorParallelLayout(config=_config(heads=heads, kv=kv, inter=inter), rank=0, size=size)


@pytest.mark.parametrize(("heads", "kv", "size"), [(8, 2, 2), (9, 3, 2), (8, 1, 4), (8, 4, 2)])
def test_checkpoint_shards_put_every_tensor_back_together(heads: int, kv: int, size: int) -> None:
    config = _config(heads=heads, kv=kv, vocab=53)
    hd, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    layouts = [TensorParallelLayout(config=config, rank=r, size=size) for r in range(size)]
    g = torch.Generator().manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(heads * hd, hidden, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(heads * hd, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * hd, hidden, generator=g),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(kv * hd, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, heads * hd, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, inter, generator=g),
        "model.embed_tokens.weight": torch.randn(53, hidden, generator=g),
        "lm_head.weight": torch.randn(53, hidden, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(hidden, generator=g),
    }
    for name, tensor in full.items():
        shards = [layout.shard_checkpoint_tensor(name, tensor) for layout in layouts]
        if "q_proj" in name or "gate_proj" in name:
            assert torch.equal(torch.cat(shards), tensor)
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(shards, dim=1), tensor)
        elif "k_proj" in name or "v_proj" in name:
            for head in range(kv):
                owner = layouts[0].kv_head_owner(head)
                local = head - layouts[owner].kv_head_start()
                assert torch.equal(shards[owner][local * hd : (local + 1) * hd], tensor[head * hd : (head + 1) * hd])
            assert all(s.shape[0] == layout.num_kv_heads * hd for s, layout in zip(shards, layouts, strict=True))
        elif "embed_tokens" in name or "lm_head" in name:
            rows = layouts[0].vocab_rows
            assert all(s.shape == (rows, hidden) for s in shards)
            assert torch.equal(torch.cat(shards)[:53], tensor)
            assert not torch.cat(shards)[53:].any()  # padding rows are zero
        else:
            assert all(s is tensor for s in shards)  # norms: every rank holds them whole


def test_quantized_weights_narrow_like_their_dense_values() -> None:
    from splitserve_runtime.quant.formats import dequantize, narrow_features
    from splitserve_runtime.quant.quantize import quantize_fp8, quantize_int4, quantize_int8

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    for quantized in (
        quantize_fp8(weight),
        quantize_int8(weight, act_quant=True),
        quantize_int4(weight, group_size=64, scale_dtype=torch.float32),
    ):
        whole = dequantize(quantized)
        for dim, start, length in ((0, 16, 32), (1, 128, 128), (1, 64, 64)):
            share = narrow_features(quantized, dim=dim, start=start, length=length)
            assert type(share) is type(quantized)
            assert torch.equal(dequantize(share), whole.narrow(dim, start, length))
    with pytest.raises(ValueError, match="int4 groups of 64 input features do not align"):
        narrow_features(quantize_int4(weight, group_size=64, scale_dtype=torch.float32), dim=1, start=32, length=64)
