"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p, seeds and logprobs,
one path for any mix of them.

A step's greedy rows take the argmax of their logits. Every other row goes through one batched
pass (:mod:`.sampling_ops`), whatever its settings: a handful of tensor operations for the
whole batch, none per row (top-p on the CPU repeats a few of them for the rows it redraws):

1. weights ``exp((logit - row max) / temperature)``, the temperatures a tensor;
2. the filters: top-k (the logits at least the k-th largest), top-p over what top-k kept (the
   tokens whose more likely tokens hold less than ``top_p`` of the mass), min-p (weights at
   least ``min_p`` of the best token's). Tokens with equal logits are kept or dropped together
   and the most likely token always stays. Top-p sorts the rows on a GPU and is done by
   rejection on the CPU, where a sort is slow: the same distribution, other tokens per seed;
3. one inverse-CDF draw per row from one uniform per row: a seeded request's from its
   :class:`~.seed_stream.SeedStream`, the others' from torch's global (CPU) generator.

**Seeds.** The uniform for a seeded request's output position ``i`` is a pure function of
``(seed, i)`` (:mod:`.seed_stream`): a step's rows of one request draw consecutive positions
(the ``1 + k`` verification rows of speculative decoding: ``n .. n + k``), and the engine gives
back the draws of rows whose tokens it did not keep (:meth:`Sampler.unwind_draws`). So the
same seed gives the same tokens whatever else shares the batch, and with speculation on or
off (:mod:`.speculative`). A disaggregated decode pod counts the draw the prefill pod made for
the first token (:meth:`Sampler.skip_draw`).

**Changed from the exponential-race sampler** (a ``torch.Generator`` per seeded request and an
``Exp(1)`` noise row per sampled row, ``argmax(p / noise)``, one generator call per seeded
row; top-p and top-k by a sort of every row): a seed now gives other tokens than before, from
the same distribution; ties at the top-k or top-p boundary are all kept where the sort's order
kept some. Greedy tokens and logprobs are unchanged. ``bench/sampler.py`` times each mix.

Logprobs are of the model's distribution (log-softmax of the raw logits, not of the filtered
or banned ones), as in vLLM's default, computed only for the rows that ask for them.

**Non-finite logits.** A row whose logits hold a NaN or +inf, or are all -inf (fp16 or fp8
overflow on a GPU), has no distribution to sample: its token was an arbitrary id (the argmax
of NaNs) and its logprobs NaN, which is not JSON (a 500 with logprobs, empty text without).
Each row's maximum is checked on the device with the rest of the step (one reduction, no extra
sync); such a row gets token 0 in place (a valid id for the next step's input, which is
dropped) and :attr:`SamplerOutput.non_finite_rows` names it, so the engine ends that request
with an error. The other rows are sampled as if it were not there: every step above is per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .outputs import TokenLogprob
from .sampling_ops import (
    block_masses,
    draw,
    redraw_outside_nucleus,
    top_k_cutoff,
    top_p_cutoff,
    top_values,
)
from .sampling_params import SamplingParams
from .seed_stream import SeedStream, seeded_uniform


@dataclass(frozen=True, kw_only=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    non_finite_rows: tuple[int, ...] = ()
    """Rows whose logits were not finite (module docstring): their token and logprobs mean
    nothing, and their requests must end with an error."""


def to_device(data: list[int] | list[float], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without stalling the host: a plain ``torch.tensor(...,
    device="cuda")`` copies from pageable memory and waits for all queued GPU work."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True, kw_only=True)
class PendingSample:
    """Sampled ids (and logprob tensors) still on the device; :meth:`resolve` syncs.

    The logprob tensors have one row per entry of ``logprob_rows`` (the rows that asked);
    ``finite`` (bool, one per row) says which rows' logits were finite (None: all)."""

    token_ids: torch.Tensor
    params: list[SamplingParams]
    chosen_logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None
    logprob_rows: list[int] = field(default_factory=list)
    finite: torch.Tensor | None = None

    def resolve(self) -> SamplerOutput:
        ids: list[int] = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(ids)
        non_finite: tuple[int, ...] = ()
        if self.finite is not None:
            finite: list[bool] = self.finite.tolist()
            if not all(finite):
                non_finite = tuple(i for i, ok in enumerate(finite) if not ok)
        if self.chosen_logprobs is None:
            return SamplerOutput(token_ids=ids, logprobs=logprobs, non_finite_rows=non_finite)
        chosen: list[float] = self.chosen_logprobs.tolist()
        top_vals: list[list[float]] = [] if self.top_values is None else self.top_values.tolist()
        top_ids: list[list[int]] = [] if self.top_indices is None else self.top_indices.tolist()
        for k, row in enumerate(self.logprob_rows):
            if non_finite and row in non_finite:
                continue  # NaN: not a number any answer may carry
            n = self.params[row].logprobs or 0
            top = list(zip(top_ids[k][:n], top_vals[k][:n], strict=True)) if n > 0 else []
            logprobs[row] = TokenLogprob(token_id=ids[row], logprob=chosen[k], top_logprobs=top)
        return SamplerOutput(token_ids=ids, logprobs=logprobs, non_finite_rows=non_finite)


class Sampler:
    """Stateless apart from the seeded requests' draw counters (keyed by request id).

    ``top_p_by_rejection``: how top-p is done (:mod:`.sampling_ops`); by default by rejection
    on the CPU and by sorting elsewhere.
    """

    def __init__(self, *, device: torch.device, top_p_by_rejection: bool | None = None) -> None:
        self.device = device
        self.top_p_by_rejection = device.type == "cpu" if top_p_by_rejection is None else top_p_by_rejection
        self._generators: dict[str, SeedStream] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's seed stream."""
        self._generators.pop(request_id, None)

    def skip_draw(self, request_id: str, *, seed: int) -> None:
        """Count a draw made for this request elsewhere (the prefill pod's first token)."""
        self._stream(request_id, seed).skip()

    def unwind_draws(self, request_id: str, count: int) -> None:
        """Give back a request's last ``count`` draws, whose tokens were not kept (rejected
        speculative rows): the next step draws those output positions again. Nothing for a
        request without a seed."""
        stream = self._generators.get(request_id)
        if stream is not None and count:
            stream.unwind(count)

    def _stream(self, request_id: str, seed: int) -> SeedStream:
        stream = self._generators.get(request_id)
        if stream is None:
            stream = self._generators[request_id] = SeedStream(seed)
        return stream

    def sample(
        self,
        *,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        banned_token_ids: list[list[int]] | None = None,
    ) -> SamplerOutput:
        """:meth:`launch` and :meth:`PendingSample.resolve` in one call."""
        return self.launch(
            logits=logits, request_ids=request_ids, params=params, banned_token_ids=banned_token_ids
        ).resolve()

    @torch.inference_mode()
    def launch(
        self,
        *,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        banned_token_ids: list[list[int]] | None = None,
    ) -> PendingSample:
        """Queue sampling for ``logits [num_rows, vocab]`` (one row per request) without
        waiting for the device.

        ``banned_token_ids[i]`` can never be chosen for row i (stop and eos tokens while a
        request is below its ``min_tokens``); logprobs still describe the unmasked model.
        """
        num_rows = logits.shape[0]
        if num_rows != len(request_ids) or num_rows != len(params):
            raise ValueError(f"{num_rows} logit rows for {len(request_ids)} requests")
        device = logits.device
        raw_logits = logits = logits.float()
        if num_rows == 0:
            return PendingSample(token_ids=torch.empty(0, dtype=torch.long), params=[])
        if banned_token_ids is not None and any(banned_token_ids):
            rows = [i for i, ids in enumerate(banned_token_ids) for _ in ids]
            cols = [t for ids in banned_token_ids for t in ids]
            logits = logits.clone()
            logits[
                to_device(rows, dtype=torch.long, device=device), to_device(cols, dtype=torch.long, device=device)
            ] = float("-inf")
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled:
            token_ids = logits.argmax(dim=-1)
        elif len(sampled) == num_rows:
            token_ids = self._sample_rows(logits, request_ids=request_ids, params=params)
        else:
            greedy_index = to_device([i for i, p in enumerate(params) if p.is_greedy], dtype=torch.long, device=device)
            sampled_index = to_device(sampled, dtype=torch.long, device=device)
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            # index_select copies rows; logits[index] gathers element by element on the CPU
            token_ids[greedy_index] = logits.index_select(0, greedy_index).argmax(dim=-1)
            token_ids[sampled_index] = self._sample_rows(
                logits.index_select(0, sampled_index),
                request_ids=[request_ids[i] for i in sampled],
                params=[params[i] for i in sampled],
            )
        finite = torch.isfinite(raw_logits.amax(dim=-1))  # NaN and +inf propagate; all -inf too
        token_ids = token_ids.masked_fill(~finite, 0)
        return _with_logprobs(raw_logits, token_ids=token_ids, params=params, finite=finite)

    def _sample_rows(
        self, logits: torch.Tensor, *, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        """One draw per row of ``logits`` (all of them sampled rows)."""
        device = logits.device
        draws: list[tuple[int, int] | None] = [
            None if p.seed is None else (p.seed, self._stream(request_ids[i], p.seed).next())
            for i, p in enumerate(params)
        ]

        def uniforms(rows: list[int], attempt: int) -> torch.Tensor:
            values: list[float] = torch.rand(len(rows), dtype=torch.float64).tolist()
            for k, row in enumerate(rows):
                key = draws[row]
                if key is not None:
                    values[k] = seeded_uniform(key[0], key[1], attempt)
            return to_device(values, dtype=torch.float64, device=device)

        temperature = to_device([p.temperature for p in params], dtype=torch.float32, device=device)
        weights = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1)).exp_()
        nucleus = filter_weights(
            logits=logits,
            weights=weights,
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            top_p_by_rejection=self.top_p_by_rejection,
        )
        tokens = draw(weights, uniforms(list(range(len(params))), 0))
        if nucleus is None:
            return tokens
        return redraw_outside_nucleus(weights=weights, bound=nucleus, tokens=tokens, uniforms=uniforms)


def _with_logprobs(
    raw_logits: torch.Tensor, *, token_ids: torch.Tensor, params: list[SamplingParams], finite: torch.Tensor
) -> PendingSample:
    """The pending sample, with the log-probabilities of the rows that ask for them."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return PendingSample(token_ids=token_ids, params=params, finite=finite)
    if len(rows) < len(params):
        index = to_device(rows, dtype=torch.long, device=raw_logits.device)
        raw_logits, chosen_ids = raw_logits.index_select(0, index), token_ids[index]
    else:
        chosen_ids = token_ids
    log_probs = torch.log_softmax(raw_logits, dim=-1)
    chosen = log_probs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    max_n = min(max(params[i].logprobs or 0 for i in rows), log_probs.shape[1])
    if max_n == 0:
        return PendingSample(
            token_ids=token_ids, params=params, chosen_logprobs=chosen, logprob_rows=rows, finite=finite
        )
    values, indices = top_values(log_probs, max_n)
    return PendingSample(
        token_ids=token_ids,
        params=params,
        chosen_logprobs=chosen,
        top_values=values,
        top_indices=indices,
        logprob_rows=rows,
        finite=finite,
    )


def filter_weights(
    *,
    logits: torch.Tensor,
    weights: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    top_p_by_rejection: bool = False,
) -> torch.Tensor | None:
    """Zero, in place, the ``weights`` (unnormalised probabilities of ``logits``, the row's
    best at 1) of tokens outside each row's top-k, top-p nucleus and min-p floor.

    ``top_k <= 0`` (or at least the vocabulary) disables top-k, ``top_p >= 1`` top-p, and
    ``min_p <= 0`` min-p. Top-p is over what top-k kept; the most likely token always stays.
    With ``top_p_by_rejection`` top-p is left to :func:`~.sampling_ops.redraw_outside_nucleus`
    and its bound returned (None when no row has top-p).
    """
    device = logits.device
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    use_top_k, use_top_p = any(ks), any(p < 1.0 for p in top_p)
    sort_top_p = use_top_p and not top_p_by_rejection
    candidates = None  # each row's largest logits, descending, and their columns
    if use_top_k or sort_top_p:
        candidates = top_values(logits, vocab if sort_top_p else max(ks))
    if candidates is not None and use_top_k:
        cutoff = top_k_cutoff(candidates[0], to_device(ks, dtype=torch.long, device=device))
        weights.masked_fill_(logits < cutoff, 0.0)
    bound = None
    if use_top_p:
        share = to_device([p if p < 1.0 else float("inf") for p in top_p], dtype=torch.float64, device=device)
        bound = share.unsqueeze(1) * block_masses(weights).sum(dim=-1, keepdim=True)
        if candidates is not None and sort_top_p:
            values, columns = candidates
            cutoff = top_p_cutoff(values=values, weights=weights.gather(1, columns), bound=bound)
            weights.masked_fill_(logits < cutoff, 0.0)
            bound = None
    if any(m > 0.0 for m in min_p):
        floor = to_device(min_p, dtype=torch.float32, device=device).unsqueeze(1)
        weights.masked_fill_(weights < floor, 0.0)
    return bound


def apply_filters(*, logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """``logits`` (temperature already applied) with the tokens :func:`filter_weights` drops
    set to ``-inf`` (and any too unlikely to be drawn in float32); top-p by sorting."""
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    filter_weights(logits=logits, weights=weights, top_k=top_k, top_p=top_p, min_p=min_p)
    return logits.masked_fill(weights == 0.0, float("-inf"))
