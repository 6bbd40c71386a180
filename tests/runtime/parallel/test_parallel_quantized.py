"""Quantized models split over ranks: each projection is decoded (or quantized) whole and then
cut in its quantized layout, so a rank holds exactly the weights a single process would, and
int4 W4A16 (no activation quantization) gives the single process's tokens at TP 2 and PP 2 —
for a load-time quantization, a pre-quantized GPTQ checkpoint, and SmolLM2's GGUF file
(Q4_1, served as int4). (W8A8 methods, whose row-parallel token scales are reduced over the
ranks, and the checks that the shards are TP 1's weights: test_quantized_tensor_parallel.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_e2e import smollm2
from splitserve_e2e.quant_checkpoints import make_gptq
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.model.tiny import write_tiny_model

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _tokens(args: ServeArgs, prompts: list[str], *, chat: bool = False) -> list[list[int]]:
    engine = LLMEngine.from_args(args)
    try:
        tok: Any = engine.tokenizer
        for i, text in enumerate(prompts):
            ids = (
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                    add_special_tokens=False,
                )
                if chat
                else tok.encode(text)
            )
            engine.add_request(request_id=f"r{i}", prompt_token_ids=ids, params=GREEDY)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id].extend(step.new_token_ids)
        return list(out.values())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model wide enough that int4 groups of 128 cut evenly at TP 2 (o_proj 256 and
    down_proj 512 input features)."""
    return write_tiny_model(
        out_dir=tmp_path_factory.mktemp("wide"),
        seed=5,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
    )


def _wide(model: Path, **overrides: Any) -> ServeArgs:
    return ServeArgs(
        model=str(model), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=256, **overrides
    )


PROMPTS = ["Once upon a time", "The quick brown fox jumps", "In a land far away"]


def test_load_time_int4_is_the_single_process_weights_on_every_split(wide_dir: Path) -> None:
    want = _tokens(_wide(wide_dir, quantization="int4"), PROMPTS)
    for layout in ("tp2", "pp2"):
        assert _tokens(_wide(wide_dir, quantization="int4", **LAYOUTS[layout]), PROMPTS) == want, layout


def test_pre_quantized_gptq_checkpoint_splits(wide_dir: Path, tmp_path: Path) -> None:
    gptq = make_gptq(dense_dir=wide_dir, out_dir=tmp_path / "gptq", group_size=128)
    want = _tokens(_wide(gptq), PROMPTS)
    assert _tokens(_wide(gptq, tensor_parallel_size=2), PROMPTS) == want


def test_gguf_file_splits() -> None:
    args = ServeArgs(
        model=str(smollm2.gguf_path()),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=512,
    )
    messages = ["Write one sentence about the sea.", "What is 2+2?"]
    want = _tokens(args, messages, chat=True)
    for layout in ("tp2", "pp2"):
        assert _tokens(dataclasses.replace(args, **LAYOUTS[layout]), messages, chat=True) == want, layout
