"""Our Llama-family forward over the paged cache vs Hugging Face ``transformers`` (the oracle).

Tolerance: fp32 logits within ``atol=rtol=1e-4`` of HF's eager implementation (observed
difference on these models: ~0, the logits themselves are O(1)).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PagedRunner
from transformers import AutoModelForCausalLM

from splitserve_runtime.model.llama import LlamaForCausalLM
from splitserve_runtime.model.loader import load_model
from splitserve_runtime.model.tiny import write_tiny_model
from splitserve_runtime.ops import get_ops

ATOL = RTOL = 1e-4
CPU = torch.device("cpu")
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "llama3-rope": {"arch": "llama", "rope_scaling": LLAMA3_SCALING, "seed": 3},
    "linear-rope": {"arch": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "seed": 4},
    "qwen2": {"arch": "qwen2", "seed": 1},
    "tied": {"arch": "llama", "tie_word_embeddings": True, "seed": 5},
    "sharded-mha": {"arch": "qwen2", "num_shards": 3, "num_kv_heads": 4, "seed": 6},
}


def _ours(model_dir: Path) -> LlamaForCausalLM:
    return load_model(
        model_dir=model_dir,
        ops=get_ops(name="torch", device=CPU),
        dtype=torch.float32,
        device=CPU,
    )


def _hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LlamaForCausalLM]:
    model_dir = write_tiny_model(out_dir=tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return _hf(model_dir), _ours(model_dir)


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir: Path) -> tuple[Any, LlamaForCausalLM]:
    return _hf(tiny_llama_dir), _ours(tiny_llama_dir)


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (length,), generator=generator).tolist()


def _hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([tokens])).logits[0].float()
        return logits


def test_prefill_logits_match_hf(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    tokens = _prompt(45, seed=0)
    got = PagedRunner(model=ours).step(prefills=[("a", tokens)], decodes=[])
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_over_cached_prefix_matches_one_shot(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    tokens = _prompt(37, seed=1)
    runner = PagedRunner(model=ours, block_size=4)
    first = runner.step(prefills=[("a", tokens[:13])], decodes=[])  # ends mid-block
    second = runner.step(prefills=[("a", tokens[13:30])], decodes=[])
    third = runner.step(prefills=[("a", tokens[30:])], decodes=[])
    one_shot = PagedRunner(model=ours).step(prefills=[("b", tokens)], decodes=[])
    torch.testing.assert_close(torch.cat([first, second, third]), one_shot, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(third, _hf_logits(hf, tokens)[30:], atol=ATOL, rtol=RTOL)


def test_ragged_batch_equals_each_sequence_alone(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    _, ours = llama_pair
    prompts = [_prompt(n, seed=n) for n in (1, 9, 23, 4)]
    batched = PagedRunner(model=ours).step(prefills=[(i, p) for i, p in enumerate(prompts)], decodes=[])
    alone = [PagedRunner(model=ours).step(prefills=[(0, p)], decodes=[]) for p in prompts]
    torch.testing.assert_close(batched, torch.cat(alone), atol=ATOL, rtol=RTOL)


def test_mixed_step_with_prefill_extend_and_decodes(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = llama_pair
    a, b, c = _prompt(11, 20), _prompt(18, 21), _prompt(7, 22)
    runner = PagedRunner(model=ours)
    runner.step(prefills=[("a", a[:-1]), ("b", b[:10])], decodes=[])
    # One step: a new prompt c, the rest of b (extend over its cached prefix), a decode of a.
    logits = runner.step(prefills=[("c", c), ("b", b[10:])], decodes=[("a", a[-1])])
    torch.testing.assert_close(logits[: len(c)], _hf_logits(hf, c), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[len(c) : len(c) + 8], _hf_logits(hf, b)[10:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[-1], _hf_logits(hf, a)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_generation_is_token_identical_to_hf_generate(
    fixture: str,
    request: pytest.FixtureRequest,
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    hf, ours = _hf(model_dir), _ours(model_dir)
    prompts = [_prompt(n, seed=100 + n) for n in (5, 17, 30)]
    got = PagedRunner(model=ours, num_blocks=96).greedy(prompts=prompts, max_new_tokens=16)
    for prompt, tokens in zip(prompts, got, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert tokens == expected
    assert len({tuple(t) for t in got}) == len(prompts), "continuations should depend on the prompt"


def test_bf16_error_is_no_worse_than_hf_bf16(tiny_llama_dir: Path) -> None:
    """In bf16 our logits must sit as close to HF's fp32 logits as HF's own bf16 run does."""
    tokens = _prompt(40, seed=7)
    hf32 = _hf_logits(_hf(tiny_llama_dir), tokens)
    hf16_model = _hf(tiny_llama_dir, torch.bfloat16)
    hf16 = _hf_logits(hf16_model, tokens)
    ours16_model = load_model(
        model_dir=tiny_llama_dir,
        ops=get_ops(name="torch", device=CPU),
        dtype=torch.bfloat16,
        device=CPU,
    )
    ours16 = PagedRunner(model=ours16_model).step(prefills=[("a", tokens)], decodes=[])
    assert ours16.dtype == torch.float32  # compute_logits always returns fp32
    hf_error = (hf16 - hf32).abs().max().item()
    assert 0 < hf_error < 0.2
    assert (ours16 - hf32).abs().max().item() <= 2 * hf_error + 1e-2


def test_mistral_architecture_matches_hf(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "mistral"))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    (model_dir / "config.json").write_text(json.dumps(config))
    tokens = _prompt(30, seed=9)
    got = PagedRunner(model=_ours(model_dir)).step(prefills=[("a", tokens)], decodes=[])
    hf = _hf(model_dir)
    assert type(hf).__name__ == "MistralForCausalLM"
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)
