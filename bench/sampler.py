"""The sampler alone: µs per step for a 256 x 32k batch of each request mix, next to one
``torch.argmax`` over the same logits.

The engine samples once per step for every running sequence, so the sampler's cost is paid per
step whatever the model costs; greedy should cost about one argmax, and a mixed batch (greedy
rows next to sampled, filtered, seeded and logprobs rows) one batched pass, not a loop over
rows. Each case runs ``--steps`` times on one :class:`Sampler` (seeded rows advance their
streams as in serving), in interleaved rounds (one step of every case per round, so load from
other processes falls on all alike); the figures are the median and the minimum over the
rounds, after one warm-up step.

Logits: ``null`` is the null model's (a flat ramp over the vocabulary plus one peak: the
nucleus of top-p 0.9 at temperature 0.8 spans most of the vocabulary, the worst case for
top-p); ``lm`` is Gaussian noise with a standard deviation of 3 (a peaked distribution in random
order, closer to a trained model's: nuclei of tens of tokens).

    python bench/sampler.py [--seqs 256] [--vocab 32000] [--steps 10] [--logits null|lm|both]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from splitserve_runtime.engine.null_model import NullModel
from splitserve_runtime.engine.sampler import Sampler
from splitserve_runtime.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)
NUCLEUS = SamplingParams(temperature=0.8, top_p=0.9)


def _mix(num_seqs: int, pick: Callable[[int], SamplingParams]) -> list[SamplingParams]:
    return [pick(i) for i in range(num_seqs)]


def cases(num_seqs: int) -> dict[str, list[SamplingParams]]:
    """Each case's per-row sampling params (row i of a mix is chosen by i modulo 4)."""
    seeded = dataclasses.replace(NUCLEUS, seed=1234)
    with_logprobs = {0: dataclasses.replace(GREEDY, logprobs=5), 1: dataclasses.replace(NUCLEUS, logprobs=5)}
    return {
        "greedy": _mix(num_seqs, lambda i: GREEDY),
        "sampled T0.8 top-p0.9": _mix(num_seqs, lambda i: NUCLEUS),
        "mixed 50/50": _mix(num_seqs, lambda i: GREEDY if i % 2 == 0 else NUCLEUS),
        "mixed, 1/4 seeded": _mix(num_seqs, lambda i: (GREEDY, NUCLEUS)[i % 2] if i % 4 < 3 else seeded),
        "all seeded": _mix(num_seqs, lambda i: dataclasses.replace(seeded, seed=i)),
        "temperature only T1": _mix(num_seqs, lambda i: SamplingParams(temperature=1.0)),
        "top-k 50": _mix(num_seqs, lambda i: SamplingParams(temperature=0.8, top_k=50)),
        "min-p 0.05": _mix(num_seqs, lambda i: SamplingParams(temperature=0.8, min_p=0.05)),
        "top-k 50 + top-p 0.9": _mix(num_seqs, lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
        "mixed 50/50 + logprobs 5": _mix(num_seqs, lambda i: with_logprobs[i % 2]),
    }


def make_logits(kind: str, *, num_seqs: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if kind == "null":
        ids = torch.randint(0, vocab, (num_seqs, 1), generator=gen).float()
        return NullModel(vocab_size=vocab).compute_logits(ids)
    if kind == "lm":
        return torch.randn(num_seqs, vocab, generator=gen) * 3
    raise ValueError(f"unknown logits kind {kind!r}; choose null, lm or both")


def bench(logits: torch.Tensor, *, steps: int) -> dict[str, tuple[float, float]]:
    """µs per step (median, min) of ``torch.argmax`` and of the sampler on each case.

    Interleaved: each round times one step of every case, so a burst of load from other
    processes falls on all cases alike; one warm-up step per case first."""
    num_seqs = logits.shape[0]
    ids = [f"r{i}" for i in range(num_seqs)]
    calls: dict[str, Callable[[], object]] = {"torch.argmax": lambda: logits.argmax(dim=-1)}
    for name, params in cases(num_seqs).items():
        calls[name] = _stepper(Sampler(device=logits.device), logits, ids, params)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(steps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(v) * 1e6, min(v) * 1e6) for name, v in times.items()}


def _stepper(
    sampler: Sampler, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
) -> Callable[[], object]:
    return lambda: sampler.sample(logits=logits, request_ids=request_ids, params=params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--logits", choices=("null", "lm", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on shared CPUs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = ("null", "lm") if args.logits == "both" else (args.logits,)
    results = {kind: bench(make_logits(kind, num_seqs=args.seqs, vocab=args.vocab), steps=args.steps) for kind in kinds}
    print(
        f"sampler, {args.seqs} rows x {args.vocab} vocab, CPU, {args.threads} thread(s), "
        f"µs per step (median / min of {args.steps} rounds); x argmax = min / argmax's min"
    )
    header = "".join(f"{kind + ' median':>14}{'min':>10}{'x argmax':>10}" for kind in kinds)
    print(f"    {'case':<28}{header}")
    for name in results[kinds[0]]:
        row = ""
        for kind in kinds:
            med, low = results[kind][name]
            row += f"{med:>14.0f}{low:>10.0f}{low / results[kind]['torch.argmax'][1]:>10.1f}"
        print(f"    {name:<28}{row}")


if __name__ == "__main__":
    main()
