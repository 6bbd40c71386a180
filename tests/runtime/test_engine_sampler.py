"""Sampler: greedy, seed determinism independent of the batch, filter masks, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve_runtime.engine.sampler import Sampler, apply_filters
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draw(sampler: Sampler, logits: torch.Tensor, request_ids: list[str],
          params: list[SamplingParams], steps: int) -> list[list[int]]:
    seqs: list[list[int]] = [[] for _ in request_ids]
    for _ in range(steps):
        out = sampler.sample(logits=logits, request_ids=request_ids, params=params)
        for i, t in enumerate(out.token_ids):
            seqs[i].append(t)
    return seqs


def test_greedy_is_argmax() -> None:
    logits = _logits(4)
    out = Sampler(device=torch.device("cpu")).sample(
        logits=logits, request_ids=list("abcd"), params=[SamplingParams(temperature=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = _logits(3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _draw(Sampler(device=torch.device("cpu")), logits[1:2], ["x"], [seeded], steps=20)[0]
    batch_params = [SamplingParams(temperature=0.7), seeded, SamplingParams(temperature=1.3, seed=9)]
    in_batch = _draw(Sampler(device=torch.device("cpu")), logits, ["p", "x", "q"], batch_params,
                     steps=20)[1]
    assert alone == in_batch
    other = _draw(Sampler(device=torch.device("cpu")), logits[1:2], ["x"],
                  [SamplingParams(temperature=1.0, seed=4321)], steps=20)[0]
    assert other != alone
    assert len(set(alone)) > 1  # it really samples


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(device=torch.device("cpu"))
    counts = [0, 0, 0]
    for t in _draw(sampler, logits, ["r"], [SamplingParams(temperature=1.0, seed=0)], steps=3000)[0]:
        counts[t] += 1
    assert counts[0] / 3000 == pytest.approx(0.7, abs=0.04)
    assert counts[2] / 3000 == pytest.approx(0.1, abs=0.03)


def test_top_k_top_p_min_p_masks() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.4, 0.3, 0.2, 0.1], [0.6, 0.3, 0.07, 0.03]])
    logits = probs.log()
    out = apply_filters(logits=logits, top_k=[2, 0, 0], top_p=[1.0, 0.65, 1.0], min_p=[0, 0, 0.1])
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, True, False, False]  # top-2
    assert kept[1] == [True, True, False, False]  # 0.4 + 0.3 >= 0.65
    assert kept[2] == [True, True, True, False]  # p >= 0.1 * 0.6
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    # filtered tokens are never sampled
    sampler = Sampler(device=torch.device("cpu"))
    params = [SamplingParams(temperature=1.0, top_k=2, seed=1)]
    drawn = _draw(sampler, logits[:1], ["r"], params, steps=300)[0]
    assert set(drawn) == {0, 1}


def test_top_p_always_keeps_the_best_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    out = apply_filters(logits=logits, top_k=[0], top_p=[0.01], min_p=[0.0])
    assert torch.isfinite(out).tolist() == [[True, False, False]]


def test_logprobs_chosen_and_top_n() -> None:
    logits = _logits(2, seed=3)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, logprobs=0)]
    out = Sampler(device=torch.device("cpu")).sample(logits=logits, request_ids=["a", "b"], params=params)
    ref = torch.log_softmax(logits, -1)
    first, second = out.logprobs
    assert first is not None and second is not None
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, ref[0].max().item(), rel_tol=1e-5)
    top_ids = [t for t, _ in first.top_logprobs]
    assert top_ids == ref[0].topk(3).indices.tolist()
    assert all(math.isclose(v, ref[0, t].item(), rel_tol=1e-5) for t, v in first.top_logprobs)
    assert second.top_logprobs == []


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError):
        Sampler(device=torch.device("cpu")).sample(
            logits=_logits(2), request_ids=["a"], params=[SamplingParams()])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop": "x"}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_banned_tokens_are_never_chosen_but_logprobs_are_unmasked() -> None:
    logits = _logits(2, seed=5)
    best = logits.argmax(-1).tolist()
    second = logits.topk(2).indices[:, 1].tolist()
    sampler = Sampler(device=torch.device("cpu"))
    out = sampler.sample(logits=logits, request_ids=["a", "b"],
                         params=[SamplingParams(temperature=0, logprobs=1)] * 2,
                         banned_token_ids=[[best[0]], []])
    assert out.token_ids == [second[0], best[1]]
    first = out.logprobs[0]
    assert first is not None and first.top_logprobs[0][0] == best[0]
    drawn = _draw(sampler, logits[:1], ["c"], [SamplingParams(temperature=1.0, seed=3)], steps=1)
    assert drawn  # sanity: the sampler still works after a banned call
    for _ in range(50):
        out = sampler.sample(logits=logits[:1], request_ids=["d"],
                             params=[SamplingParams(temperature=2.0, seed=11)],
                             banned_token_ids=[[best[0], second[0]]])
        assert out.token_ids[0] not in (best[0], second[0])
