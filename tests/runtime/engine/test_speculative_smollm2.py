"""Speculative decoding on a real model (SmolLM2-135M-Instruct): greedy output is token for
token the plain one with n-gram proposals and with a draft model (the same model cut to its
first 8 of 30 layers: same vocabulary, real but weaker predictions)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from splitserve_contract import ServeArgs
from splitserve_e2e import smollm2
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams

DRAFT_LAYERS = 8
MESSAGES = [
    "Repeat this list exactly, in the same order: apples, pears, plums, cherries, grapes, figs.",
    "Add type hints to this Python function and return it:\ndef area(width, height):\n    return width * height",
    "Write one sentence about the sea.",
]


def truncated_copy(source: Path, target: Path, *, num_layers: int) -> Path:
    """``source`` (an HF Llama dir) with only its first ``num_layers`` decoder layers."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, target / item.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    kept = {
        name: t
        for name, t in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2.hf_dir()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    engine = _engine(model_dir)
    tok: Any = engine.tokenizer
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for m in MESSAGES
    ]


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine.from_args(
        ServeArgs(
            model=str(model_dir),
            device="cpu",
            attention_backend="torch",
            dtype="float32",
            max_model_len=512,
            num_kv_blocks=128,
            block_size=16,
            **overrides,
        )
    )


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(request_id=str(i), prompt_token_ids=prompt, params=params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].extend(step.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_ngram_and_draft_speculation_keep_the_greedy_output(
    model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    want = _greedy(_engine(model_dir), prompts)
    draft = truncated_copy(model_dir, tmp_path / "draft", num_layers=DRAFT_LAYERS)
    for settings in (
        {"speculative_method": "ngram"},
        {"speculative_method": "draft", "speculative_draft_model": str(draft)},
    ):
        engine = _engine(model_dir, **settings)
        assert _greedy(engine, prompts) == want, settings
        stats = engine.stats()
        rate = stats.spec_decode_accepted_tokens_total / max(stats.spec_decode_proposed_tokens_total, 1)
        print(
            f"\n{settings['speculative_method']}: proposed {stats.spec_decode_proposed_tokens_total}, "
            f"accepted {stats.spec_decode_accepted_tokens_total} ({rate:.0%}), "
            f"{stats.generation_tokens_total} tokens in {stats.steps_total} steps"
        )
        assert stats.spec_decode_accepted_tokens_total > 0
