"""A load-time quantized model is the same model at TP 2 as at TP 1.

The defect this pins: quantized models gave different greedy text at TP 2 than at TP 1 (the
review measured int4 0/20, int8 5/20, fp8 1/20 prompts identical on the tiny Llama; before the
fix this file's 10 prompts x 16 tokens gave int4 0/10 on the default tiny model, int8 4/10 and
3/10, fp8 0/10 and 0/10 on the tiny and the wide one), because int4 fell back to quantizing each rank's half of a row-parallel projection with its own
smaller groups, and W8A8 (int8, fp8) layers took each token's activation scale over the rank's
half of the input of ``o_proj``/``down_proj``. Now every projection is quantized whole, with the
groups and scales of TP 1, and then cut; an int4 cut that is not on group boundaries is refused
at load time naming the projection; and a row-parallel W8A8 projection takes the max of the
ranks' per-token amaxes before it quantizes its input slice, so the scale is TP 1's.

Two checks per method: the weights each rank holds, dequantized and put back together, are
exactly TP 1's quantized weights (fast, no processes), and the real TP 2 engine (two processes,
gloo) gives TP 1's greedy tokens for every prompt.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve_contract import ServeArgs
from splitserve_contract.model_config import load_model_config
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.model.errors import ModelLoadError
from splitserve_runtime.model.llama import LINEAR_NAMES, LlamaForCausalLM
from splitserve_runtime.model.loader import load_model
from splitserve_runtime.model.tensor_parallel import TensorParallelLayout
from splitserve_runtime.model.tiny import write_tiny_model
from splitserve_runtime.ops import get_ops
from splitserve_runtime.quant.formats import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    LinearWeight,
    QuantizedWeight,
    dequantize,
)

CPU = torch.device("cpu")
METHODS = ("int4", "int8", "fp8")
_KIND: dict[str, type[QuantizedWeight]] = {"int4": Int4Weight, "int8": Int8Weight, "fp8": Fp8Weight}
# The HF modules of each fused projection, in their row order.
_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
TEXTS = [
    "Once upon a time",
    "The quick brown fox jumps",
    "In a land far away",
    "She opened the door and",
    "Numbers: one two three",
    "The weather today is",
    "A long time ago in",
    "My favourite food is",
    "Rain falls on the",
    "He said that the",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (hidden 64, 4 heads of 16, intermediate 128): the shape the
    defect was measured on. Too narrow for int4 at TP 2 (its groups of 64 and 128 cannot be
    cut in half)."""
    return write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama wide enough that int4 groups of 128 cut evenly at TP 2 (o_proj 256 and
    down_proj 512 input features, 128 and 256 a rank)."""
    return write_tiny_model(
        out_dir=tmp_path_factory.mktemp("wide"),
        seed=5,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
    )


class _NoCollectives:
    """Loading a rank never communicates; the forward would (and is run by the engine tests)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("loading must not communicate")

    def gather_vocab(self, local: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
        raise AssertionError("loading must not communicate")


def _load(model_dir: Path, quantization: str, layout: TensorParallelLayout | None = None) -> LlamaForCausalLM:
    return load_model(
        model_dir=model_dir,
        ops=get_ops(name="torch", device=CPU),
        dtype=torch.float32,
        device=CPU,
        quantization=quantization,
        parallel=(layout, _NoCollectives()) if layout is not None else None,
    )


def _rows(layout: TensorParallelLayout, fused: str) -> list[tuple[int, int, int, int]]:
    """``(dim, start, length, full_offset)`` of each HF part of ``fused`` for this rank: the
    part's slice along ``dim`` and where the part starts in the full fused weight's rows."""
    config = layout.config
    sizes = {
        "self_attn.q_proj": config.q_size,
        "self_attn.k_proj": config.kv_size,
        "self_attn.v_proj": config.kv_size,
        "mlp.gate_proj": config.intermediate_size,
        "mlp.up_proj": config.intermediate_size,
    }
    out, offset = [], 0
    for part in _PARTS[fused]:
        dim, start, length = layout.projection_slice(part)
        out.append((dim, start, length, offset))
        offset += sizes.get(part, 0)
    return out


@pytest.mark.parametrize(
    ("model", "method"), [("wide", "int4"), ("wide", "int8"), ("wide", "fp8"), ("tiny", "int8"), ("tiny", "fp8")]
)
def test_rank_shards_reconstruct_the_single_process_quantized_weights(
    model: str, method: str, tiny_dir: Path, wide_dir: Path
) -> None:
    model_dir = wide_dir if model == "wide" else tiny_dir
    config = load_model_config(model_dir=model_dir)
    single = _load(model_dir, method)
    layouts = [TensorParallelLayout(config=config, rank=rank, size=2) for rank in range(2)]
    ranks = [_load(model_dir, method, layout) for layout in layouts]
    for layer in range(config.num_hidden_layers):
        for fused in LINEAR_NAMES:
            want_weight: LinearWeight = getattr(single.decoder_layers()[layer], fused)
            assert isinstance(want_weight, _KIND[method]), (fused, type(want_weight))
            want = dequantize(want_weight)
            rebuilt = torch.full_like(want, float("nan"))
            for layout, shard in zip(layouts, ranks, strict=True):
                weight: LinearWeight = getattr(shard.decoder_layers()[layer], fused)
                assert isinstance(weight, _KIND[method]), (fused, type(weight))
                if isinstance(weight, Int4Weight):
                    assert isinstance(want_weight, Int4Weight) and weight.group_size == want_weight.group_size
                mine = dequantize(weight)
                local_row = 0
                for dim, start, length, offset in _rows(layout, fused):
                    if dim == 0:  # column-parallel: a slice of the part's output rows
                        rebuilt[offset + start : offset + start + length] = mine[local_row : local_row + length]
                        local_row += length
                    else:  # row-parallel: a slice of the input columns
                        rebuilt[:, start : start + length] = mine
            assert torch.equal(rebuilt, want), f"layer {layer} {fused} ({method}): shards differ from TP 1"


def test_int4_that_cannot_cut_on_group_boundaries_is_refused_naming_the_layer(tiny_dir: Path) -> None:
    """The default tiny model's row-parallel projections have one int4 group per row (o_proj 64
    input features, a group of 64; down_proj 128, a group of 128): half a row is not a whole
    group, so TP 2 cannot hold TP 1's weights and says so at load time, naming the projection
    and its sizes, instead of quantizing each half with groups of its own."""
    config = load_model_config(model_dir=tiny_dir)
    with pytest.raises(ModelLoadError) as caught:
        _load(tiny_dir, "int4", TensorParallelLayout(config=config, rank=1, size=2))
    message = str(caught.value)
    named = re.search(r"model\.layers\.0\.(self_attn\.o_proj \(64 x 64\)|mlp\.down_proj \(64 x 128\))", message)
    assert named is not None, message
    assert "tensor-parallel rank 1 of 2" in message and "int4 groups of" in message, message


def _tokens(model_dir: Path, **overrides: Any) -> list[list[int]]:
    """Greedy tokens of every prompt, from one batch (tensor-parallel workers stopped after)."""
    args = ServeArgs(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_model_len=256,
        **overrides,
    )
    engine = LLMEngine.from_args(args)
    try:
        tok: Any = engine.tokenizer
        for i, text in enumerate(TEXTS):
            engine.add_request(request_id=f"r{i}", prompt_token_ids=tok.encode(text), params=GREEDY)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(TEXTS))}
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id].extend(step.new_token_ids)
        return list(out.values())
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("model", "method"), [("wide", "int4"), ("tiny", "int8"), ("tiny", "fp8"), ("wide", "int8"), ("wide", "fp8")]
)
def test_tp2_greedy_text_is_tp1s(model: str, method: str, tiny_dir: Path, wide_dir: Path) -> None:
    model_dir = wide_dir if model == "wide" else tiny_dir
    want = _tokens(model_dir, quantization=method)
    got = _tokens(model_dir, quantization=method, tensor_parallel_size=2)
    same = sum(a == b for a, b in zip(want, got, strict=True))
    assert same == len(TEXTS), f"{method} on the {model} model: {same}/{len(TEXTS)} prompts identical at TP 2"
