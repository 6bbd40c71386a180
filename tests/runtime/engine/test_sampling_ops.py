"""The sampler's batched steps: the two-level inverse-CDF draw, the block-narrowed top-k, the
cut-offs, top-p by rejection, and the counter-based seed streams."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve_runtime.engine.sampling_ops import (
    DRAW_BLOCK,
    TOPK_BLOCK,
    draw,
    redraw_outside_nucleus,
    top_k_cutoff,
    top_p_cutoff,
    top_values,
)
from splitserve_runtime.engine.seed_stream import SeedStream, mix64, seeded_uniform

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _stratified(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 0.5) / n


@pytest.mark.parametrize("vocab", [7, DRAW_BLOCK, 3 * DRAW_BLOCK, 2 * DRAW_BLOCK + 77])
def test_draw_is_the_inverse_cdf_across_blocks(vocab: int) -> None:
    """Stratified uniforms: each column comes out in exact proportion to its weight, zero
    columns (block edges, the partial last block) never."""
    columns = sorted({0, vocab // 3, min(DRAW_BLOCK - 1, vocab - 1), min(DRAW_BLOCK, vocab - 1), vocab - 1})
    weight = torch.zeros(vocab)
    for i, c in enumerate(columns):
        weight[c] = float(i + 1)
    n = 3000
    drawn = draw(weight.expand(n, vocab).contiguous(), _stratified(n))
    counts = torch.bincount(drawn, minlength=vocab)
    assert set(torch.nonzero(counts).squeeze(1).tolist()) == set(columns)
    for c in columns:
        assert abs(counts[c].item() - n * weight[c].item() / weight.sum().item()) <= 1


def test_draw_edges_of_the_unit_interval() -> None:
    weight = torch.zeros(2, 3 * DRAW_BLOCK + 5)
    weight[:, [5, DRAW_BLOCK + 1, 3 * DRAW_BLOCK + 2]] = torch.tensor([1e-3, 1.0, 1e-30])
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    first, last = draw(weight, u).tolist()
    assert first == 5
    assert last in (DRAW_BLOCK + 1, 3 * DRAW_BLOCK + 2)  # never a zero column past the last weight


def _ascending(rows: int, vocab: int) -> torch.Tensor:
    """The null model's shape: a ramp (the worst case for a heap) plus one peak per row."""
    x = torch.linspace(0.0, 1.0, vocab).repeat(rows, 1)
    x[torch.arange(rows), torch.arange(rows) * 7 % vocab] = 8.0
    return x


@pytest.mark.parametrize("vocab", [1000, 4096, 50])
@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("shape", ["random", "ascending", "ties"])
def test_top_values_equal_topk(vocab: int, k: int, shape: str) -> None:
    gen = torch.Generator().manual_seed(vocab + k)
    if shape == "random":
        x = torch.randn(6, vocab, generator=gen)
    elif shape == "ascending":
        x = _ascending(6, vocab)
    else:
        x = torch.randint(0, 4, (6, vocab), generator=gen).float()
    values, columns = top_values(x, k)
    assert torch.equal(values, x.topk(k).values)
    assert torch.equal(x.gather(1, columns), values)
    assert all(len(set(row)) == k for row in columns.tolist())


def test_top_values_narrows_by_blocks_on_the_cpu() -> None:
    """The narrowing really runs (4 k blocks fit in the row), including the partial last block."""
    vocab = 40 * TOPK_BLOCK + 3
    x = torch.zeros(2, vocab)
    x[0, vocab - 1] = 5.0  # the best value of row 0 in the partial block
    x[1, 3] = 5.0
    values, columns = top_values(x, 2)
    assert columns[:, 0].tolist() == [vocab - 1, 3]
    assert values[:, 0].tolist() == [5.0, 5.0]
    with pytest.raises(ValueError, match="k must be"):
        top_values(x, 0)


def test_cutoffs_keep_ties_together() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    values, _ = top_values(logits, 5)
    assert top_k_cutoff(values, torch.tensor([2])).item() == 2.0  # all three 2.0s stay
    assert top_k_cutoff(values, torch.tensor([0])).item() == -math.inf
    weights = torch.exp(values - 3.0)
    mass = weights.sum(dim=-1, keepdim=True).double()
    # the best holds 0.5 of the mass here: 0.4 keeps it alone, 0.6 the whole tie after it
    share = weights[0, 0].item() / mass.item()
    assert top_p_cutoff(values=values, weights=weights, bound=(share - 0.01) * mass).item() == 3.0
    assert top_p_cutoff(values=values, weights=weights, bound=(share + 0.01) * mass).item() == 2.0
    assert (
        top_p_cutoff(values=values, weights=weights, bound=torch.full((1, 1), math.inf, dtype=torch.float64)).item()
        == -math.inf
    )


def test_rejection_keeps_draws_inside_the_nucleus() -> None:
    """Flat rows (the nucleus is most of the row, many first draws land outside it) and peaked
    rows: every token ends inside its nucleus, in proportion to its weight."""
    vocab, n = 40, 4000
    weights = torch.cat(
        [
            torch.linspace(1.0, 0.5, vocab).expand(n // 2, vocab),
            (0.5 ** torch.arange(vocab, dtype=torch.float32)).expand(n // 2, vocab),
        ]
    )
    mass = weights.sum(dim=-1, keepdim=True).double()
    bound = 0.6 * mass
    gen = torch.Generator().manual_seed(0)

    def uniforms(rows: list[int], attempt: int) -> torch.Tensor:
        return torch.rand(len(rows), dtype=torch.float64, generator=gen)

    first = draw(weights, uniforms(list(range(n)), 0))
    tokens = redraw_outside_nucleus(weights=weights, bound=bound, tokens=first, uniforms=uniforms)
    for half, row in ((slice(0, n // 2), weights[0]), (slice(n // 2, n), weights[-1])):
        heavier = torch.tensor([row[row > w].sum() for w in row])
        nucleus = heavier < 0.6 * row.sum()
        counts = torch.bincount(tokens[half], minlength=vocab).double()
        assert counts[~nucleus].sum() == 0
        expected = row * nucleus / (row * nucleus).sum() * (n // 2)
        chi2 = ((counts - expected)[nucleus] ** 2 / expected[nucleus]).sum().item()
        assert chi2 < 60  # df <= 24: far above any fair draw's, far below a skewed one's
    assert (first[: n // 2] != tokens[: n // 2]).any()  # the flat rows were redrawn


def test_seed_stream_is_splitmix64() -> None:
    # SplitMix64's published outputs for state 1234567 (Vigna's reference implementation)
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert [mix64((1234567 + (i + 1) * GAMMA) & MASK64) for i in range(3)] == want
    start = mix64(42)
    assert seeded_uniform(42, 2) == (mix64((start + 3 * GAMMA) & MASK64) >> 11) * 2.0**-53
    # pinned: a change here changes every seeded request's tokens (say so in the changelog)
    assert seeded_uniform(0, 0) == pytest.approx(0.8833108082136426, abs=0.0)
    assert seeded_uniform(-1, 5) == seeded_uniform(2**64 - 1, 5)  # seeds modulo 2**64, like torch


def test_seed_stream_counts_draws_and_attempts_differ() -> None:
    stream = SeedStream(7)
    assert [stream.next(), stream.next()] == [0, 1]
    stream.skip()
    assert stream.next() == 3
    with pytest.raises(ValueError):
        stream.skip(-1)
    with pytest.raises(ValueError):
        seeded_uniform(7, -1)
    draws = {seeded_uniform(7, i, a) for i in range(50) for a in range(4)}
    assert len(draws) == 200
    values = [seeded_uniform(7, i) for i in range(20000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert sum(values) / len(values) == pytest.approx(0.5, abs=0.01)
