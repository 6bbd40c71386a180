"""Sampler: greedy, seed determinism independent of the batch, filter masks, the filtered
distributions (top-p by rejection and by sorting), logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from splitserve_runtime.engine.sampler import Sampler, apply_filters
from splitserve_runtime.engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draw(
    sampler: Sampler, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams], steps: int
) -> list[list[int]]:
    seqs: list[list[int]] = [[] for _ in request_ids]
    for _ in range(steps):
        out = sampler.sample(logits=logits, request_ids=request_ids, params=params)
        for i, t in enumerate(out.token_ids):
            seqs[i].append(t)
    return seqs


def test_greedy_is_argmax() -> None:
    logits = _logits(4)
    out = Sampler(device=torch.device("cpu")).sample(
        logits=logits, request_ids=list("abcd"), params=[SamplingParams(temperature=0)] * 4
    )
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = _logits(3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _draw(Sampler(device=torch.device("cpu")), logits[1:2], ["x"], [seeded], steps=20)[0]
    batch_params = [SamplingParams(temperature=0.7), seeded, SamplingParams(temperature=1.3, seed=9)]
    in_batch = _draw(Sampler(device=torch.device("cpu")), logits, ["p", "x", "q"], batch_params, steps=20)[1]
    assert alone == in_batch
    other = _draw(
        Sampler(device=torch.device("cpu")), logits[1:2], ["x"], [SamplingParams(temperature=1.0, seed=4321)], steps=20
    )[0]
    assert other != alone
    assert len(set(alone)) > 1  # it really samples


def test_a_seed_draws_by_output_position_and_unwound_draws_are_drawn_again() -> None:
    """A step with ``1 + k`` rows of one request (speculative verification) draws output
    positions ``n .. n + k``; once the rows after the kept ones are given back, the next step
    draws the same position with the same uniform as a request sampled one row a step."""
    logits = _logits(1)
    seeded = SamplingParams(temperature=4.0, seed=77)
    one_a_step = _draw(Sampler(device=torch.device("cpu")), logits, ["x"], [seeded], steps=16)[0]
    assert len(set(one_a_step)) > 1
    sampler = Sampler(device=torch.device("cpu"))
    got: list[int] = []
    for rows, kept in ((4, 2), (3, 3), (1, 1), (5, 1), (4, 4), (2, 1)):
        out = sampler.sample(logits=logits.expand(rows, VOCAB), request_ids=["x"] * rows, params=[seeded] * rows)
        assert out.token_ids == one_a_step[len(got) : len(got) + rows]  # position n + j, row j
        got += out.token_ids[:kept]
        sampler.unwind_draws("x", rows - kept)
    assert got == one_a_step[:12]
    sampler.unwind_draws("unseeded", 3)  # no stream, nothing to give back
    with pytest.raises(ValueError, match="cannot unwind 20 of 12 draws"):
        sampler.unwind_draws("x", 20)


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
        Sampler(device=torch.device("cpu")).sample(logits=_logits(2), request_ids=["a"], params=[SamplingParams()])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": "x"}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_banned_tokens_are_never_chosen_but_logprobs_are_unmasked() -> None:
    logits = _logits(2, seed=5)
    best = logits.argmax(-1).tolist()
    second = logits.topk(2).indices[:, 1].tolist()
    sampler = Sampler(device=torch.device("cpu"))
    out = sampler.sample(
        logits=logits,
        request_ids=["a", "b"],
        params=[SamplingParams(temperature=0, logprobs=1)] * 2,
        banned_token_ids=[[best[0]], []],
    )
    assert out.token_ids == [second[0], best[1]]
    first = out.logprobs[0]
    assert first is not None and first.top_logprobs[0][0] == best[0]
    drawn = _draw(sampler, logits[:1], ["c"], [SamplingParams(temperature=1.0, seed=3)], steps=1)
    assert drawn  # sanity: the sampler still works after a banned call
    for _ in range(50):
        out = sampler.sample(
            logits=logits[:1],
            request_ids=["d"],
            params=[SamplingParams(temperature=2.0, seed=11)],
            banned_token_ids=[[best[0], second[0]]],
        )
        assert out.token_ids[0] not in (best[0], second[0])


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution of one row, by the definitions: top-k keeps the logits at
    least the k-th largest; top-p (over what top-k kept) the tokens whose strictly more likely
    tokens hold less than top_p; min-p the tokens at least min_p as likely as the best."""
    scaled = logits / p.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < p.top_k < scaled.numel():
        keep &= scaled >= scaled.sort(descending=True).values[p.top_k - 1]
    probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1).double()
    if p.top_p < 1.0:
        keep &= torch.tensor([probs[probs > q].sum() < p.top_p for q in probs])
    keep &= probs >= p.min_p * probs.max()
    kept = probs * keep
    return kept / kept.sum()


FILTERED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=6, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.5),
]


@pytest.mark.parametrize("by_rejection", [True, False], ids=["top-p by rejection", "top-p by sort"])
def test_filtered_distributions(by_rejection: bool) -> None:
    """Each setting's tokens follow its reference distribution, in one batch of all of them
    (seeded rows, each its own request), and never leave it."""
    logits = torch.randn(len(FILTERED), 12, generator=torch.Generator().manual_seed(1)) * 1.5
    n = 3000
    params = [dataclasses.replace(p, seed=1000 * i + j) for j in range(n) for i, p in enumerate(FILTERED)]
    rows = logits.repeat(n, 1)
    sampler = Sampler(device=torch.device("cpu"), top_p_by_rejection=by_rejection)
    out = sampler.sample(logits=rows, request_ids=[f"r{i}" for i in range(len(params))], params=params)
    drawn = torch.tensor(out.token_ids).view(n, len(FILTERED))
    for i, p in enumerate(FILTERED):
        want = _reference(logits[i], p)
        counts = torch.bincount(drawn[:, i], minlength=12).double()
        assert counts[want == 0].sum() == 0, p
        expected = want * n
        chi2 = ((counts - expected)[want > 0] ** 2 / expected[want > 0]).sum().item()
        assert chi2 < 45, (p, chi2)  # df <= 11


def test_top_p_on_a_flat_row_of_a_large_vocabulary() -> None:
    """The null model's shape (a ramp and a peak): the nucleus is most of the row, so most
    first draws by rejection land outside it; both methods keep exactly the nucleus."""
    vocab = 3 * 256 + 40
    logits = torch.linspace(0.0, 1.0, vocab).unsqueeze(0).repeat(2, 1)
    logits[:, 100] = 4.0
    params = [SamplingParams(temperature=0.8, top_p=0.8, seed=i) for i in range(400)]
    want = _reference(logits[0], params[0]) > 0
    assert 0.2 * vocab < want.sum() < 0.9 * vocab
    for by_rejection in (True, False):
        sampler = Sampler(device=torch.device("cpu"), top_p_by_rejection=by_rejection)
        out = sampler.sample(
            logits=logits[:1].expand(400, vocab), request_ids=[f"r{i}" for i in range(400)], params=params
        )
        assert all(want[t] for t in out.token_ids)
        assert len(set(out.token_ids)) > 100


@pytest.mark.parametrize("by_rejection", [True, False], ids=["top-p by rejection", "top-p by sort"])
def test_seeded_rows_ignore_their_neighbours(by_rejection: bool) -> None:
    """A seeded request with filters draws the same tokens alone and in mixed batches
    (greedy, unseeded, logprobs, banned, other seeds; before and after it)."""
    logits = torch.linspace(0.0, 1.0, 700).repeat(5, 1) + torch.randn(
        5, 700, generator=torch.Generator().manual_seed(2)
    )
    mine = SamplingParams(temperature=0.9, top_p=0.8, top_k=300, min_p=0.01, seed=77)
    steps = 12

    def run(neighbours: list[SamplingParams], where: int) -> list[int]:
        sampler = Sampler(device=torch.device("cpu"), top_p_by_rejection=by_rejection)
        params = neighbours[:where] + [mine] + neighbours[where:]
        ids = [f"n{i}" for i in range(len(neighbours))]
        ids.insert(where, "mine")
        rows = torch.cat([logits[1 : 1 + where], logits[:1], logits[1 + where : 1 + len(neighbours)]])
        banned = [[3, 4]] + [[]] * (len(params) - 1)
        return [
            sampler.sample(
                logits=rows, request_ids=ids, params=params, banned_token_ids=banned if where else None
            ).token_ids[where]
            for _ in range(steps)
        ]

    alone = run([], 0)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_p=0.3),
        SamplingParams(temperature=0.5, seed=5, logprobs=2),
        SamplingParams(temperature=2.0, top_p=0.95),
    ]
    assert run(others, 0) == alone
    assert run(others, 2) == alone
    assert run(others, 4) == alone
    assert len(set(alone)) > 3


def test_rows_of_one_request_draw_in_order() -> None:
    """Speculative verification samples several rows of one request in one call: they take the
    request's draws in row order, as one call per row would."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=9)
    together = Sampler(device=torch.device("cpu")).sample(logits=logits, request_ids=["x"] * 3, params=[p] * 3)
    sampler = Sampler(device=torch.device("cpu"))
    one_by_one = [
        sampler.sample(logits=logits[i : i + 1], request_ids=["x"], params=[p]).token_ids[0] for i in range(3)
    ]
    assert together.token_ids == one_by_one


def test_skip_draw_lines_up_a_decode_pod() -> None:
    """The prefill pod draws token 1; the decode pod skips that draw and draws what an
    aggregated engine draws second."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(temperature=1.0, seed=31)
    aggregated = _draw(Sampler(device=torch.device("cpu")), logits, ["x"], [p], steps=6)[0]
    decode = Sampler(device=torch.device("cpu"))
    decode.skip_draw("x", seed=31)
    assert _draw(decode, logits, ["x"], [p], steps=5)[0] == aggregated[1:]
    decode.release("x")
    assert decode._generators == {}


def test_mixed_batch_greedy_rows_and_logprobs() -> None:
    """Greedy rows of a mixed batch are their argmax; logprobs come only for the rows that ask,
    of the raw distribution, for the token each row drew."""
    logits = _logits(6, seed=8)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logprobs=2),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=0, logprobs=4),
        SamplingParams(temperature=1.0, seed=1),
    ]
    out = Sampler(device=torch.device("cpu")).sample(logits=logits, request_ids=list("abcdef"), params=params)
    best = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [best[i] for i in (0, 2, 4)]
    ref = torch.log_softmax(logits, -1)
    assert [lp is None for lp in out.logprobs] == [True, False, False, True, False, True]
    for i in (1, 2, 4):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, ref[i, out.token_ids[i]].item(), rel_tol=1e-5)
        n = params[i].logprobs or 0
        assert [t for t, _ in lp.top_logprobs] == ref[i].topk(n).indices.tolist()[:n]
        assert all(math.isclose(v, ref[i, t].item(), rel_tol=1e-5) for t, v in lp.top_logprobs)
