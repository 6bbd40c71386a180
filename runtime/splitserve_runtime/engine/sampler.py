"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p, and logprobs.

Randomness is drawn per request: a request with a ``seed`` owns a ``torch.Generator``
seeded once, and its noise row is drawn from that generator alone, so the same seed gives
the same tokens whatever else shares the batch. Sampling uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``), which equals sampling from ``p`` and needs one
noise row per request instead of a ``multinomial`` call per row.

Filters are applied to temperature-scaled logits in one batched pass over the sorted
logits; requests without filters skip the sort entirely. Logprobs are of the model's
distribution (log-softmax of the raw logits), as in vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .outputs import TokenLogprob
from .sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Stateless apart from the per-request generators (keyed by request id)."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[request_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, *, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams],
               banned_token_ids: list[list[int]] | None = None) -> SamplerOutput:
        """``logits [num_rows, vocab]`` (fp32), one row per request in ``request_ids``.

        ``banned_token_ids[i]`` can never be chosen for row i (stop and eos tokens while a
        request is below its ``min_tokens``); logprobs still describe the unmasked model.
        """
        num_rows = logits.shape[0]
        if num_rows != len(request_ids) or num_rows != len(params):
            raise ValueError(f"{num_rows} logit rows for {len(request_ids)} requests")
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw_logits = logits = logits.float()
        if banned_token_ids is not None and any(banned_token_ids):
            rows = [i for i, ids in enumerate(banned_token_ids) for _ in ids]
            cols = [t for ids in banned_token_ids for t in ids]
            logits = logits.index_put((torch.tensor(rows, device=logits.device),
                                       torch.tensor(cols, device=logits.device)),
                                      torch.tensor(float("-inf"), device=logits.device))
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            token_ids = greedy_ids.clone()
            sampled = self._sample_random(
                logits=logits[random_rows], request_ids=[request_ids[i] for i in random_rows],
                params=[params[i] for i in random_rows])
            token_ids[random_rows] = sampled
        else:
            token_ids = greedy_ids
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if any(want_logprobs):
            logprobs = _logprobs(logits=raw_logits, token_ids=token_ids, params=params)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _sample_random(self, *, logits: torch.Tensor, request_ids: list[str],
                       params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        scaled = logits / temperature.unsqueeze(1)
        scaled = apply_filters(
            logits=scaled,
            top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params])
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=self._generator(request_ids[i], p.seed))
        return (probs / noise).argmax(dim=-1)


def apply_filters(*, logits: torch.Tensor, top_k: list[int], top_p: list[float],
                  min_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus / min-p floor to ``-inf``.

    ``top_k <= 0`` disables top-k; ``top_p >= 1`` disables top-p; ``min_p <= 0`` disables
    min-p. The most likely token always survives.
    """
    vocab = logits.shape[1]
    device = logits.device
    use_top_k = any(0 < k < vocab for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if use_top_k or use_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=device)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            remove |= ranks >= k.unsqueeze(1)
        if use_top_p:
            probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
            p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
            remove |= cum_before >= p
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = torch.tensor(min_p, device=device, dtype=probs.dtype).unsqueeze(1)
        floor = floor * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs(*, logits: torch.Tensor, token_ids: torch.Tensor,
              params: list[SamplingParams]) -> list[TokenLogprob | None]:
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    ids = token_ids.tolist()
    max_n = min(max((p.logprobs or 0) for p in params), logits.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_n > 0:
        values, indices = log_probs.topk(max_n, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    result: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        n = p.logprobs
        top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n > 0 else []
        result.append(TokenLogprob(token_id=ids[i], logprob=chosen[i], top_logprobs=top))
    return result
