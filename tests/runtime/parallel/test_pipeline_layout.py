"""Pipeline stages: every layer in exactly one stage (the earlier stages take the remainder),
checkpoint names mapped to a stage's local indices, and a step's rows cut into micro-batches
that keep their order and balance their tokens."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve_contract.model_config import ModelConfig
from splitserve_runtime.engine.parallel.pipeline import split_rows
from splitserve_runtime.engine.step_inputs import DecodeRow, PrefillRow, StepRows
from splitserve_runtime.model.pipeline import PipelineError, PipelineStage

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=50,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=30,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attention_bias=False,
    sliding_window=None,
    eos_token_ids=(0,),
    bos_token_id=None,
    torch_dtype=None,
)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 7, 8])
def test_layers_are_cut_into_consecutive_stages(num_stages: int) -> None:
    stages = [PipelineStage(config=CONFIG, stage=s, num_stages=num_stages) for s in range(num_stages)]
    ranges = [stage.layer_range() for stage in stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    counts = [end - start for start, end in ranges]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    assert [s.local_config().num_hidden_layers for s in stages] == counts


def test_names_map_to_the_stage_that_holds_them() -> None:
    first, last = (PipelineStage(config=CONFIG, stage=s, num_stages=2) for s in (0, 1))
    assert first.local_name("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj.weight"
    assert last.local_name("model.layers.3.mlp.down_proj.weight") is None
    assert last.local_name("model.layers.17.self_attn.k_scale") == "model.layers.2.self_attn.k_scale"
    assert first.local_name("model.embed_tokens.weight") is not None
    assert last.local_name("model.embed_tokens.weight") is not None  # tied: the LM head is the embedding
    untied = PipelineStage(config=dataclasses.replace(CONFIG, tie_word_embeddings=False), stage=1, num_stages=2)
    assert untied.local_name("model.embed_tokens.weight") is None
    assert untied.local_name("lm_head.weight") == "lm_head.weight"
    assert first.local_name("model.norm.weight") is None and first.local_name("lm_head.weight") is None


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(PipelineError, match="exceeds the model's 30 layers"):
        PipelineStage(config=CONFIG, stage=0, num_stages=31)


def _rows(prefill_lengths: list[int], decodes: int) -> StepRows:
    return StepRows(
        prefills=[PrefillRow(token_ids=[1] * n, start_position=0, block_table=[0]) for n in prefill_lengths],
        decodes=[DecodeRow(token_id=1, position=5, block_table=[0]) for _ in range(decodes)],
        sample_prefill=[1] * len(prefill_lengths),
    )


@pytest.mark.parametrize(
    ("prefills", "decodes", "parts"),
    [([], 8, 4), ([40], 8, 4), ([10, 10, 10, 10], 0, 2), ([100], 0, 4), ([], 3, 8), ([5, 30], 20, 4)],
)
def test_micro_batches_keep_every_row_in_order(prefills: list[int], decodes: int, parts: int) -> None:
    rows = _rows(prefills, decodes)
    batches = split_rows(rows, parts=parts)
    assert 1 <= len(batches) <= min(parts, len(prefills) + decodes)
    assert [r for b in batches for r in b.prefills] == rows.prefills
    assert [r for b in batches for r in b.decodes] == rows.decodes
    assert [s for b in batches for s in b.sample_prefill] == rows.sample_prefill
    assert all(b.prefills or b.decodes for b in batches)
    for batch in batches:  # prefill rows before decode rows in each micro-batch
        assert not batch.prefills or batch is batches[0] or not any(b.decodes for b in batches[: batches.index(batch)])


def test_decode_rows_are_balanced() -> None:
    sizes = [len(b.decodes) for b in split_rows(_rows([], 256), parts=4)]
    assert sizes == [64, 64, 64, 64]
