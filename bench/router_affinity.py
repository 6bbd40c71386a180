"""Prefix-cache hit rate on the prefill pods: PrefixAffinity vs RoundRobin routing, one run.

A shared-system-prompt workload (N requests in K prefix groups: each request is one of K long
system prompts plus its own question) goes through the real router to 2 real prefill pods and
1 decode pod (tiny model, CPU, loopback). Both routers run over the same pods; each phase
uses its own fresh set of K prefixes so neither phase finds the other's KV cached. The figure
is the prefill pods' `splitserve_prefix_cache_hit_tokens_total / _queried_tokens_total` over
the phase, with the router's matched-block counter beside it.

    python bench/router_affinity.py [--requests 48] [--groups 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime" / "disagg"))
from disagg_harness import MODEL_NAME, Cluster, Proc  # noqa: E402

from splitserve_contract import Metric  # noqa: E402

WORDS = (
    "river",
    "stone",
    "lamp",
    "market",
    "winter",
    "signal",
    "garden",
    "ledger",
    "copper",
    "harbor",
    "violet",
    "engine",
    "meadow",
    "thunder",
    "canvas",
    "orbit",
)


def _system_prompt(rng: random.Random) -> str:
    return "You are an assistant for " + " ".join(rng.choice(WORDS) for _ in range(60)) + "."


def _sum(pods: list[Proc], name: str) -> float:
    return float(sum(p.metric(name) for p in pods))


def _phase(
    *, cluster: Cluster, router: Proc, groups: list[str], num_requests: int, rng: random.Random
) -> dict[str, float]:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    hit0 = _sum(cluster.prefill, Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL)
    queried0 = _sum(cluster.prefill, Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL)
    matched0 = router.metric("splitserve_router_prefix_matched_blocks_total")
    queried_blocks0 = router.metric("splitserve_router_prefix_queried_blocks_total")
    started = time.perf_counter()
    for i in range(num_requests):
        question = f" Question {i}: what about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
        client.completions.create(model=MODEL_NAME, prompt=rng.choice(groups) + question, max_tokens=2, temperature=0)
    seconds = time.perf_counter() - started
    hit = _sum(cluster.prefill, Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL) - hit0
    queried = _sum(cluster.prefill, Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL) - queried0
    return {
        "hit_rate": hit / queried if queried else 0.0,
        "hit_tokens": hit,
        "queried_tokens": queried,
        "router_matched": router.metric("splitserve_router_prefix_matched_blocks_total") - matched0,
        "router_queried": router.metric("splitserve_router_prefix_queried_blocks_total") - queried_blocks0,
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from splitserve_runtime.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(out_dir=Path(tmp) / "model", arch="llama", seed=0)
        with Cluster(
            model_dir=model_dir, log_dir=Path(tmp), num_prefill=2, num_decode=1, policy="RoundRobin"
        ) as cluster:
            assert cluster.router is not None
            affinity = cluster.router_proc(policy="PrefixAffinity", octet=30)
            cluster.start_router(affinity)
            rng = random.Random(args.seed)
            results = {}
            for name, router in (("RoundRobin", cluster.router), ("PrefixAffinity", affinity)):
                groups = [_system_prompt(rng) for _ in range(args.groups)]
                results[name] = _phase(
                    cluster=cluster, router=router, groups=groups, num_requests=args.requests, rng=rng
                )
    print(
        f"workload: {args.requests} requests in {args.groups} shared-system-prompt groups, "
        "2 prefill pods x 64 KV blocks of 16 tokens, 1 decode pod, tiny model on CPU"
    )
    print(
        f"{'policy':<16}{'prefill hit rate':>18}{'hit/queried tokens':>22}{'router matched/queried blocks':>32}{'s':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<16}{r['hit_rate']:>18.3f}{int(r['hit_tokens']):>11}/{int(r['queried_tokens']):<10}"
            f"{int(r['router_matched']):>20}/{int(r['router_queried']):<11}{r['seconds']:>7.1f}"
        )
    rr, pa = results["RoundRobin"]["hit_rate"], results["PrefixAffinity"]["hit_rate"]
    print(f"affinity / round-robin hit rate: {pa / rr if rr else float('inf'):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
