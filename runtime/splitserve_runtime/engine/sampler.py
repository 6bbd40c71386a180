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


def to_device(data: list[int] | list[float], *, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without stalling the host: a plain ``torch.tensor(...,
    device="cuda")`` copies from pageable memory and waits for all queued GPU work."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True, kw_only=True)
class PendingSample:
    """Sampled ids (and logprob tensors) still on the device; :meth:`resolve` syncs."""

    token_ids: torch.Tensor
    params: list[SamplingParams]
    chosen_logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None

    def resolve(self) -> SamplerOutput:
        ids: list[int] = self.token_ids.tolist()
        if self.chosen_logprobs is None:
            return SamplerOutput(token_ids=ids, logprobs=[None] * len(ids))
        chosen: list[float] = self.chosen_logprobs.tolist()
        top_vals: list[list[float]] = [] if self.top_values is None else self.top_values.tolist()
        top_ids: list[list[int]] = [] if self.top_indices is None else self.top_indices.tolist()
        logprobs: list[TokenLogprob | None] = []
        for i, p in enumerate(self.params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            n = p.logprobs
            top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n > 0 else []
            logprobs.append(TokenLogprob(token_id=ids[i], logprob=chosen[i], top_logprobs=top))
        return SamplerOutput(token_ids=ids, logprobs=logprobs)


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

    def sample(self, *, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams],
               banned_token_ids: list[list[int]] | None = None) -> SamplerOutput:
        """:meth:`launch` and :meth:`PendingSample.resolve` in one call."""
        return self.launch(logits=logits, request_ids=request_ids, params=params,
                           banned_token_ids=banned_token_ids).resolve()

    @torch.inference_mode()
    def launch(self, *, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams],
               banned_token_ids: list[list[int]] | None = None) -> PendingSample:
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
            logits[to_device(rows, dtype=torch.long, device=device),
                   to_device(cols, dtype=torch.long, device=device)] = float("-inf")
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            index = to_device(random_rows, dtype=torch.long, device=device)
            token_ids = greedy_ids.clone()
            token_ids[index] = self._sample_random(
                logits=logits[index], request_ids=[request_ids[i] for i in random_rows],
                params=[params[i] for i in random_rows])
        else:
            token_ids = greedy_ids
        if all(p.logprobs is None for p in params):
            return PendingSample(token_ids=token_ids, params=params)
        log_probs = torch.log_softmax(raw_logits, dim=-1)
        chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        max_n = min(max((p.logprobs or 0) for p in params), log_probs.shape[1])
        if max_n == 0:
            return PendingSample(token_ids=token_ids, params=params, chosen_logprobs=chosen)
        values, indices = log_probs.topk(max_n, dim=-1)
        return PendingSample(token_ids=token_ids, params=params, chosen_logprobs=chosen,
                             top_values=values, top_indices=indices)

    def _sample_random(self, *, logits: torch.Tensor, request_ids: list[str],
                       params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperature = to_device([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits / temperature.unsqueeze(1)
        scaled = apply_filters(
            logits=scaled,
            top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params])
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[to_device(unseeded, dtype=torch.long, device=device)] = torch.empty(
                len(unseeded), probs.shape[1], device=device).exponential_()
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
            k = to_device([kk if 0 < kk < vocab else vocab for kk in top_k], dtype=torch.long,
                          device=device)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            remove |= ranks >= k.unsqueeze(1)
        if use_top_p:
            probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
            p = to_device(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
            remove |= cum_before >= p
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = to_device(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
        floor = floor * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits

