"""The disaggregated demo burst without the cluster: 1 prefill pod, 1 decode pod and a router as
real processes on loopback (the test harness, ``tests/runtime/disagg/disagg_harness.py``), the demo's
own load generator (:class:`splitserve_e2e.demo.LoadBurst`: streaming completions of ~120-word
prompts, 48 tokens each) and the demo's engine settings, with a KV pool small enough that
exported (pinned) KV fills it under load.

It counts what the issue counts: requests the client saw fail, and what the pods saw (prefill
requests that failed, such as ``export_failed``, the routes the router took, KV pulls that
failed). Figures go to stdout as JSON, and to ``$OUT/disagg_burst.json`` when ``$OUT`` is set.

    python bench/disagg_burst.py [--requests 300] [--concurrency 24] [--num-kv-blocks 96]
        [--prefill-overflow-tokens N[,N...]]

``--prefill-overflow-tokens 0,2000`` runs the burst once per value (the router's conditional
disaggregation; 0: off) and prints each run's time to first token beside the routes it took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "runtime" / "disagg"))  # the harness the disagg tests use

from disagg_harness import Cluster, Proc  # noqa: E402

from splitserve_contract import Metric  # noqa: E402
from splitserve_e2e.demo import LoadBurst, percentile  # noqa: E402


def _pod_figures(pod: Proc) -> dict[str, float]:
    return {
        "requests_ok": pod.metric(Metric.REQUESTS_TOTAL, outcome="success"),
        "requests_error": pod.metric(Metric.REQUESTS_TOTAL, outcome="error"),
        "requests_rejected": pod.metric(Metric.REQUESTS_TOTAL, outcome="rejected"),
        "preemptions": pod.metric(Metric.PREEMPTIONS_TOTAL),
        "kv_transfer_failures": pod.metric(Metric.KV_TRANSFER_FAILURES_TOTAL),
    }


def run(
    *,
    requests: int,
    concurrency: int,
    num_kv_blocks: int,
    max_tokens: int,
    prompt_words: int,
    work_dir: Path,
    prefill_overflow_tokens: int = 0,
) -> dict[str, Any]:
    from splitserve_runtime.model.tiny import write_tiny_model

    model_dir = write_tiny_model(out_dir=work_dir / "tiny-llama", arch="llama", seed=0)
    engine = {"num_kv_blocks": num_kv_blocks, "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024}
    with Cluster(
        model_dir=model_dir,
        log_dir=work_dir,
        num_prefill=1,
        num_decode=1,
        short_prompt_threshold=8,
        health_interval_seconds=2.0,
        prefill_overflow_tokens=prefill_overflow_tokens,
        prefill_overrides=engine,
        decode_overrides=engine,
    ) as cluster:
        assert cluster.router is not None
        burst = LoadBurst(
            base_url=cluster.router_url,
            concurrency=concurrency,
            duration_seconds=3600.0,
            prompt_words=prompt_words,
            max_tokens=max_tokens,
            max_requests=requests,
        )
        started = time.monotonic()
        asyncio.run(burst.run())
        seconds = time.monotonic() - started
        router = cluster.router
        prefill_log = cluster.prefill[0].log_tail(num_chars=50_000_000)
        router_log = router.log_tail(num_chars=50_000_000)
        first_tokens = [r.first_token_seconds for r in burst.results if r.first_token_seconds is not None]
        errors: dict[str, int] = {}
        for error in burst.errors():
            errors[error[:120]] = errors.get(error[:120], 0) + 1
        return {
            "requests": len(burst.results),
            "ok": burst.ok,
            "failed": burst.failed,
            "client_errors": errors,
            "seconds": round(seconds, 1),
            "settings": {
                "concurrency": concurrency,
                "max_tokens": max_tokens,
                "prompt_words": prompt_words,
                "prefill_overflow_tokens": prefill_overflow_tokens,
                **engine,
            },
            "ttft_ms": {f"p{q}": round(percentile(first_tokens, q / 100.0) * 1e3, 1) for q in (50, 90, 99)},
            "routes": {
                route: router.metric("splitserve_router_routes_total", route=route)
                for route in ("disaggregated", "direct", "fallback", "overflow")
            },
            "router_prefill_upstream_errors": router.metric(
                "splitserve_router_upstream_errors_total", upstream="prefill"
            ),
            "router_lines_prefill_5xx": router_log.count("answered 502"),
            "prefill_log_export_failed": prefill_log.count("export_failed"),
            "prefill": _pod_figures(cluster.prefill[0]),
            "decode": _pod_figures(cluster.decode[0]),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument(
        "--prefill-overflow-tokens",
        default="0",
        help="comma-separated: one run per value (the router's --prefill-overflow-tokens)",
    )
    parser.add_argument(
        "--keep-logs", type=Path, default=None, help="write the pods' logs here instead of a temporary directory"
    )
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for limit in (int(v) for v in args.prefill_overflow_tokens.split(",") if v):
        with tempfile.TemporaryDirectory(prefix="disagg-burst-") as tmp:
            work_dir = (args.keep_logs / f"overflow-{limit}") if args.keep_logs else Path(tmp)
            work_dir.mkdir(parents=True, exist_ok=True)
            runs.append(
                run(
                    requests=args.requests,
                    concurrency=args.concurrency,
                    num_kv_blocks=args.num_kv_blocks,
                    max_tokens=args.max_tokens,
                    prompt_words=args.prompt_words,
                    work_dir=work_dir,
                    prefill_overflow_tokens=limit,
                )
            )
    figures: dict[str, Any] | list[dict[str, Any]] = runs[0] if len(runs) == 1 else runs
    text = json.dumps(figures, indent=2)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "disagg_burst.json").write_text(text + "\n")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
