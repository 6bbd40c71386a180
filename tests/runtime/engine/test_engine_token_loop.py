"""The engine's per-token loop against the plain stop test it inlines.

The loop (``LLMEngine._append_tokens``) does not call :meth:`StopChecker.check_token` per
token: it reads the stop/eos ids, ``min_tokens`` and a precomputed length limit copied onto
the request when it is created. Here every finish of many random requests (eos, stop ids,
``ignore_eos``, ``min_tokens``, ``max_tokens``, in every step mode) must be the one the plain
test gives on the null model's known token chain.
"""

from __future__ import annotations

import random

import pytest
import torch

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel, null_next_token
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.stop_checker import StopChecker

VOCAB = 48
EOS = frozenset({5, 17})


def _expected(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Greedy tokens and finish reason from the null model's chain and the plain stop test.
    Below ``min_tokens`` the sampler bans the ending ids: the null model's next best token is
    then the highest id not banned (its logits rise with the id)."""
    checker = StopChecker(params=params, eos_token_ids=EOS, detokenizer=None)
    tokens: list[int] = []
    token = prompt[-1]
    while True:
        token = null_next_token(token, vocab_size=VOCAB)
        if len(tokens) < params.min_tokens and token in checker.stop_token_ids:
            token = max(set(range(VOCAB)) - checker.stop_token_ids)
        tokens.append(token)
        reason = checker.check_token(token_id=token, num_output_tokens=len(tokens))
        if reason is not None:
            return tokens, reason


@pytest.mark.parametrize(("overlap", "async_scheduling"), [(False, False), (True, False), (False, True)])
def test_every_finish_matches_the_plain_stop_test(overlap: bool, async_scheduling: bool) -> None:
    rng = random.Random(7)
    model = NullModel(vocab_size=VOCAB)
    engine = LLMEngine(
        model=model,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        eos_token_ids=EOS,
        kv_spec=KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32),
        config=EngineConfig(
            max_model_len=40,
            block_size=4,
            num_kv_blocks=256,
            max_num_seqs=12,
            max_num_batched_tokens=64,
            async_scheduling=async_scheduling,
        ),
        overlap_output_processing=overlap,
    )
    expected: dict[str, tuple[list[int], str]] = {}
    for i in range(60):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        max_tokens = rng.randint(1, 20)
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens),
            stop_token_ids=rng.sample(range(VOCAB), rng.randint(0, 3)),
            ignore_eos=rng.random() < 0.3,
        )
        expected[f"r{i}"] = _expected(prompt, params)
        engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    engine.close()
    assert {rid: (got.get(rid, []), reasons.get(rid)) for rid in expected} == expected
    assert {reason for _, reason in expected.values()} == {"stop", "length"}  # both kinds were hit
    stats = engine.stats()
    assert stats.generation_tokens_total == sum(len(tokens) for tokens, _ in expected.values())
