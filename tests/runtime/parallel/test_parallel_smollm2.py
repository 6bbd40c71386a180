"""Tensor and pipeline parallelism on a real model (SmolLM2-135M-Instruct: 30 layers, 9 query
heads, 3 KV heads, tied embeddings). At TP 2 its KV groups split unevenly (1 and 2 per rank:
3 and 6 query heads), which is how a model whose heads do not divide by the group size is
served at all; at PP 2 its layers split 15/15, the last stage holding the tied embedding for
the LM head. fp32, greedy: the tokens are the single-process engine's, and the
log-probabilities of every generated token and of its top-5 alternatives are within 1e-4 of
Hugging Face transformers (the numerical oracle) on the same token sequence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitserve_contract import ServeArgs
from splitserve_e2e import smollm2
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import TokenLogprob
from splitserve_runtime.engine.sampling_params import SamplingParams

MESSAGES = ["Write one sentence about the sea.", "What is the capital of France? Answer briefly."]
MAX_TOKENS = 16
TOP = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2.hf_dir()


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}


def _engine(model_dir: Path, layout: str) -> LLMEngine:
    return LLMEngine.from_args(
        ServeArgs(
            model=str(model_dir),
            device="cpu",
            attention_backend="torch",
            dtype="float32",
            max_model_len=512,
            num_kv_blocks=64,
            block_size=16,
            **LAYOUTS[layout],
        )
    )


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[TokenLogprob]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    for i, prompt in enumerate(prompts):
        engine.add_request(request_id=f"m{i}", prompt_token_ids=prompt, params=params)
    out: dict[str, list[TokenLogprob]] = {f"m{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].extend(step.new_logprobs or [])
    return out


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> Iterator[tuple[list[list[int]], dict[str, dict[str, list[TokenLogprob]]]]]:
    single = _engine(model_dir, "tp1")
    tok: Any = single.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for m in MESSAGES
    ]
    results = {"tp1": _generate(single, prompts)}
    for layout in ("tp2", "pp2"):
        parallel = _engine(model_dir, layout)
        try:
            results[layout] = _generate(parallel, prompts)
            shares = {"tp2": (30, 1), "pp2": (15, 3)}[layout]  # rank 0's layers and KV heads
            assert (parallel.runner.spec.num_layers, parallel.runner.spec.num_kv_heads) == shares
        finally:
            parallel.close()
    yield prompts, results


Runs = tuple[list[list[int]], dict[str, dict[str, list[TokenLogprob]]]]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_tokens_equal_single(runs: Runs, layout: str) -> None:
    _, results = runs
    tokens = {name: {rid: [lp.token_id for lp in lps] for rid, lps in out.items()} for name, out in results.items()}
    assert tokens[layout] == tokens["tp1"]
    assert all(len(t) == MAX_TOKENS for t in tokens[layout].values())


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_logprobs_match_transformers(model_dir: Path, runs: Runs, layout: str) -> None:
    prompts, results = runs
    hf: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), torch_dtype=torch.float32, attn_implementation="eager"
    )
    for i, prompt in enumerate(prompts):
        generated = results[layout][f"m{i}"]
        sequence = prompt + [lp.token_id for lp in generated]
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : len(sequence) - 1], dim=-1)
        for position, lp in enumerate(generated):
            assert lp.token_id == int(expected[position].argmax())
            got = torch.tensor([lp.logprob] + [v for _, v in lp.top_logprobs])
            want = torch.tensor(
                [float(expected[position, lp.token_id])] + [float(expected[position, t]) for t, _ in lp.top_logprobs]
            )
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
            assert [t for t, _ in lp.top_logprobs] == expected[position].topk(TOP).indices.tolist()
