"""The batched tensor steps of sampling: the k largest logits of each row, the filters'
cut-offs, and one inverse-CDF draw per row.

Every function takes a whole batch with per-row settings as tensors: no loop over rows, so a
step is a handful of kernels whatever mix of requests it holds.

**Cut-offs, not ranks.** Top-k and top-p keep the tokens whose logit is at least a per-row
cut-off; tokens with equal logits are kept or dropped together, so what a row keeps depends on
that row alone, not on how a sort orders ties.

**The draw** is inverse-CDF with one uniform per row, in two levels: the mass of each block of
:data:`DRAW_BLOCK` tokens, then the prefix sums of the one block the uniform falls in. An
exponential race (``argmax(p / E)``) needs a random number per vocabulary entry: 8M
exponentials took 160+ ms of a 256 x 32k step on one CPU core; this draw costs less than a pass
over the logits.

**Top-p** needs the tokens in order of probability. A GPU sorts the rows (fast there) and cuts
at :func:`top_p_cutoff`. On the CPU a sort of 256 x 32k took 110-600 ms, so
:func:`redraw_outside_nucleus` samples the nucleus by rejection instead: draw from the row, keep
the token if the tokens more likely than it hold less than ``top_p`` of the mass, else drop it
and every token no more likely than it (none of them is in the nucleus) and draw again. The
first check is a pass over the top-p rows; about ``1 - top_p`` of them draw again, fewer each
time (256 rows at top-p 0.9: 256, then about 25, then a few). The tokens come out with exactly
the nucleus' distribution, though not the tokens the sort's cut-off gives for the same
uniforms.

**Top-k** on the CPU: :func:`top_values` first narrows each row to the blocks holding its
largest values (``torch.topk`` walks a heap that a row in ascending order, the null model's,
makes 30x slower than one pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch

DRAW_BLOCK: Final = 256
"""Tokens per block of the two-level draw."""
TOPK_BLOCK: Final = 32
"""Columns per block when :func:`top_values` narrows a row on the CPU."""


def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x [rows, vocab]``, descending, and their
    columns. The values equal ``torch.topk``'s; among equal values the columns may differ.

    On the CPU a small ``k`` first picks, per row, the ``k`` blocks of :data:`TOPK_BLOCK`
    columns with the largest maxima: every one of the ``k`` largest values lies in them (a
    value outside is at most its block's maximum, at most the least of the ``k`` chosen maxima,
    which are ``k`` values of the chosen blocks), so ``topk`` runs over ``k`` blocks.
    """
    rows, vocab = x.shape
    if not 0 < k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    if k == vocab:
        return x.sort(dim=-1, descending=True)
    if x.device.type != "cpu" or 4 * k * TOPK_BLOCK > vocab:
        values, columns = x.topk(k, dim=-1)
        return values, columns
    full = vocab // TOPK_BLOCK
    block_max = x[:, : full * TOPK_BLOCK].reshape(rows, full, TOPK_BLOCK).amax(dim=-1)
    blocks = block_max.topk(k, dim=-1).indices
    offsets = torch.arange(TOPK_BLOCK, device=x.device)
    columns = (blocks.unsqueeze(-1) * TOPK_BLOCK + offsets).flatten(1)
    if vocab > full * TOPK_BLOCK:  # the partial last block is always a candidate
        tail = torch.arange(full * TOPK_BLOCK, vocab, device=x.device)
        columns = torch.cat([columns, tail.expand(rows, -1)], dim=1)
    values, picked = x.gather(1, columns).topk(k, dim=-1)
    return values, columns.gather(1, picked)


def top_k_cutoff(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]``: each row's ``top_k``-th largest logit (``values`` are each row's largest,
    descending, at least ``top_k`` of them); ``-inf`` where ``top_k`` is 0 (off)."""
    kth = values.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    return kth.masked_fill(top_k.unsqueeze(1) == 0, float("-inf"))


def top_p_cutoff(*, values: torch.Tensor, weights: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]``: each row's top-p cut-off, ``-inf`` where ``bound`` is infinite (off).

    ``values [rows, vocab]``: the row's logits, descending; ``weights``: their unnormalised
    probabilities (zero where an earlier filter dropped them); ``bound [rows, 1]``: ``top_p``
    times the row's total weight. A token is kept while the tokens before it weigh less than
    the bound, so the most likely token always is; the cut-off is the last kept one's logit.
    """
    cumulative = weights.cumsum(dim=-1)  # the CPU accumulates in float64
    # token j is kept while cumulative[j - 1] < bound: the first, and one past each prefix sum
    # below the bound (prefix sums of non-negative weights are sorted)
    below = torch.searchsorted(cumulative, bound.float().clamp(max=torch.finfo(torch.float32).max))
    cutoff = values.gather(1, below.clamp(max=values.shape[1] - 1))
    return cutoff.masked_fill(bound.isinf(), float("-inf"))


def block_masses(weights: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks]`` float64: the weight of each block of :data:`DRAW_BLOCK` columns."""
    rows, vocab = weights.shape
    full = vocab // DRAW_BLOCK
    parts = []
    if full:
        parts.append(weights[:, : full * DRAW_BLOCK].reshape(rows, full, DRAW_BLOCK).sum(dim=-1))
    if vocab > full * DRAW_BLOCK:
        parts.append(weights[:, full * DRAW_BLOCK :].sum(dim=-1, keepdim=True))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).double()


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One column per row of ``weights [rows, vocab]`` (non-negative, unnormalised, a positive
    one in every row), column ``j`` with probability ``weights[j] / sum``: the first column whose
    prefix sum exceeds ``uniforms [rows]`` (float64, in ``[0, 1)``) times the row's total."""
    rows, vocab = weights.shape
    cumulative = block_masses(weights).cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cumulative[:, -1:]
    # argmax of a non-decreasing row: its first maximum, the last block with weight (rounding
    # can put the target at the total)
    block = torch.minimum(torch.searchsorted(cumulative, target, right=True), cumulative.argmax(dim=-1, keepdim=True))
    start = block * DRAW_BLOCK
    columns = start + torch.arange(DRAW_BLOCK, device=weights.device)
    inner = weights.gather(1, columns.clamp(max=vocab - 1)).double()
    if vocab % DRAW_BLOCK:
        inner.masked_fill_(columns >= vocab, 0.0)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cumulative = inner.cumsum(dim=-1)
    offset = torch.minimum(
        torch.searchsorted(inner_cumulative, target - before, right=True), inner_cumulative.argmax(dim=-1, keepdim=True)
    )
    return (start + offset).squeeze(1).clamp(max=vocab - 1)


UniformsFor = Callable[[list[int], int], torch.Tensor]
"""``(rows, attempt) -> [len(rows)]`` float64 uniforms for those rows' attempt ``attempt``."""


def redraw_outside_nucleus(
    *, weights: torch.Tensor, bound: torch.Tensor, tokens: torch.Tensor, uniforms: UniformsFor
) -> torch.Tensor:
    """Top-p by rejection: ``tokens`` (a :func:`draw` from ``weights``, attempt 0) with each
    token outside its row's nucleus replaced by a draw from inside it.

    ``bound [rows, 1]``: ``top_p`` times the row's weight before top-p (after top-k), ``inf``
    for rows without top-p. A token is in the nucleus when the tokens strictly heavier than it
    weigh less than the bound. Rejecting token ``t`` drops every token no heavier than ``t``:
    each weighs at least as much above it, so none is in the nucleus, and the nucleus stays
    whole; the heaviest token is always in it, so the loop ends.
    """
    active = torch.isfinite(bound).squeeze(1).nonzero().squeeze(1)
    if not active.numel():
        return tokens
    tokens = tokens.clone()
    rows = weights.index_select(0, active) if active.numel() < weights.shape[0] else weights  # not written
    bound, drawn = bound[active], tokens[active].unsqueeze(1)
    attempt = 0
    while True:
        pivot = rows.gather(1, drawn)
        heavier = _weight_above(rows, pivot)
        rejected = (heavier >= bound).squeeze(1).nonzero().squeeze(1)
        if not rejected.numel():
            return tokens
        attempt += 1
        active, rows, bound = active[rejected], rows.index_select(0, rejected), bound[rejected]
        rows.masked_fill_(rows <= pivot[rejected], 0.0)
        drawn = draw(rows, uniforms(active.tolist(), attempt)).unsqueeze(1)
        tokens[active] = drawn.squeeze(1)


def _weight_above(rows: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]`` float64: the total of each row's weights strictly above its ``pivot``, as
    ``sum(relu(w - pivot)) + pivot * count(w > pivot)``: vectorised passes, where
    ``torch.where`` (a scalar loop on the CPU) took 3-5x as long."""
    excess = (rows - pivot).relu_()
    total = excess.sum(dim=-1, keepdim=True).double()
    count = excess.sign_().sum(dim=-1, keepdim=True).double()  # exact below 2**24 columns
    return total + pivot.double() * count
