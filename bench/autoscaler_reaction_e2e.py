"""Autoscaler reaction time on the whole real stack, in units of (scrape + evaluation interval).

``bench/autoscaler_reaction.py`` times the control loop alone (simulated pods and queues).
This one times what a user sees: the local control plane (real scheduler and ReplicaSets),
Prometheus scraping real runtime pods (tiny model on CPU, containers from the image built
from this tree on the kubelet node, ``hf://`` from a hub), the operator installed by its chart, and a load step through the router's OpenAI endpoint:

* load step (2 -> ``--concurrency`` streams) -> first ``spec.replicas`` write (reaction) and
  -> a second pod Ready (capacity; adds pod start-up: process, model load, readiness probe);
* load drop -> first scale-down write (expected: the scale-down stabilization window plus the
  smoothing window plus up to one interval) and -> back at one replica.

Each figure is also printed as a multiple of ``scrape + interval``: the least time any
metrics-driven loop can take to see a step and act on it.

An HPA-style CPU rule is not measured: this cluster has no metrics-server (the kubelet serves
resource metrics, but nothing aggregates them into the metrics API), and the controller
manager runs without the horizontal-pod-autoscaler controller; the comparison would need
both. The script says so in its output.

    python bench/autoscaler_reaction_e2e.py [--scrape-seconds 2] [--interval 5s] [--trials 1]

Writes ``$OUT/autoscaler_reaction_e2e.json`` when ``OUT`` is set. About 3-4 minutes per trial
on two cores (binaries cached).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from splitserve_contract import Role, defaults
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import ClusterOptions, LocalCluster
from splitserve_e2e.demo import LoadBurst, router_endpoints, wait_ready
from splitserve_e2e.demo import apply_object as apply
from splitserve_e2e.image import ensure_image
from splitserve_e2e.stack import (
    MODEL_NAME,
    ModelHub,
    ensure_model_cache,
    isvc_manifest,
    operator_namespace,
    start_model_hub,
)
from splitserve_operator.api import parse_duration_seconds
from splitserve_operator.naming import child_name

NAMESPACE = "bench-reaction"
NAME = "react"
HUB_TOKEN = "hf_bench_token"
POLL_SECONDS = 0.25
HPA_NOTE = (
    "HPA-style CPU rule: not measured. It needs metrics-server (absent: nothing "
    "aggregates the kubelet's resource metrics into the metrics API) and the "
    "horizontal-pod-autoscaler controller (not enabled in the harness's "
    "kube-controller-manager)."
)


def _replicas(cluster: LocalCluster) -> tuple[int, int]:
    deployment: Any = cluster.apps().read_namespaced_deployment(child_name(NAME, Role.AGGREGATED), NAMESPACE)
    return int(deployment.spec.replicas or 0), int(deployment.status.ready_replicas or 0)


async def _watch(
    cluster: LocalCluster, *, until: Any, timeout_seconds: float
) -> tuple[float | None, list[tuple[float, int, int]]]:
    """Poll replicas until ``until(desired, ready)``; (seconds it took or None, samples)."""
    started = time.monotonic()
    samples: list[tuple[float, int, int]] = []
    while time.monotonic() - started < timeout_seconds:
        desired, ready = await asyncio.to_thread(_replicas, cluster)
        elapsed = time.monotonic() - started
        samples.append((round(elapsed, 2), desired, ready))
        if until(desired, ready):
            return elapsed, samples
        await asyncio.sleep(POLL_SECONDS)
    return None, samples


async def _trial(
    cluster: LocalCluster, *, base_url: str, concurrency: int, down_timeout_seconds: float
) -> dict[str, Any]:
    baseline = LoadBurst(base_url=base_url, concurrency=2, duration_seconds=15, prompt_words=20, max_tokens=16)
    await baseline.run()
    start_desired, _ = await asyncio.to_thread(_replicas, cluster)
    step = LoadBurst(base_url=base_url, concurrency=concurrency, duration_seconds=180)
    task = asyncio.create_task(step.run())
    write, _ = await _watch(cluster, until=lambda d, r: d > start_desired, timeout_seconds=150)
    ready = None
    if write is not None:
        more, _ = await _watch(cluster, until=lambda d, r: r > start_desired, timeout_seconds=150)
        ready = None if more is None else write + more
    step.stop()
    await task
    peak, _ = await asyncio.to_thread(_replicas, cluster)
    down, _ = await _watch(cluster, until=lambda d, r: d < peak, timeout_seconds=down_timeout_seconds)
    at_min = None
    if down is not None:
        rest, _ = await _watch(cluster, until=lambda d, r: d == start_desired, timeout_seconds=down_timeout_seconds)
        at_min = None if rest is None else down + rest
    return {
        "load_step_to_replicas_write_s": write,
        "load_step_to_new_pod_ready_s": ready,
        "peak_replicas": peak,
        "load_drop_to_first_scale_down_s": down,
        "load_drop_to_min_replicas_s": at_min,
        "requests_ok": step.ok + baseline.ok,
        "requests_failed": step.failed + baseline.failed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    interval_seconds = parse_duration_seconds(args.interval)
    unit = args.scrape_seconds + interval_seconds
    image = ensure_image()
    with tempfile.TemporaryDirectory(prefix="sbe-", dir=cache_root()) as tmp:
        options = ClusterOptions(num_gpu_nodes=0, scrape_interval_seconds=args.scrape_seconds)
        with LocalCluster(state_dir=Path(tmp) / "c", options=options) as cluster:
            assert cluster.prometheus_url is not None and cluster.pod_gateway is not None
            model_dir = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
            hub, _ = start_model_hub(
                model_dir=model_dir, root=Path(tmp) / "hub", token=HUB_TOKEN, host=cluster.pod_gateway, port=0
            )
            model_hub = ModelHub(endpoint=hub.endpoint, token=HUB_TOKEN)
            try:
                with operator_namespace(
                    cluster=cluster, image=image, hub=model_hub, stem=NAMESPACE, unique=False
                ) as namespace:
                    apply(
                        cluster=cluster,
                        obj=isvc_manifest(
                            name=NAME,
                            namespace=namespace,
                            mode="Aggregated",
                            hub=model_hub,
                            interval=args.interval,
                            max_replicas=3,
                            scale_down_stabilization_seconds=args.down_stabilization_seconds,
                        ),
                    )
                    wait_ready(cluster=cluster, namespace=namespace, name=NAME, timeout_seconds=300)
                    endpoint = router_endpoints(cluster=cluster, namespace=namespace, name=NAME)[0]
                    down_timeout = args.down_stabilization_seconds + defaults.SIGNAL_WINDOW_SECONDS + 90
                    trials = [
                        asyncio.run(
                            _trial(
                                cluster,
                                base_url=f"http://{endpoint}/v1",
                                concurrency=args.concurrency,
                                down_timeout_seconds=down_timeout,
                            )
                        )
                        for _ in range(args.trials)
                    ]
            finally:
                hub.stop()

    def figure(key: str) -> dict[str, float | None]:
        values = [t[key] for t in trials if t[key] is not None]
        median = statistics.median(values) if values else None
        return {
            "median_s": None if median is None else round(median, 2),
            "multiple_of_scrape_plus_interval": None if median is None else round(median / unit, 2),
            "observed": float(len(values)),
            "trials": float(len(trials)),
        }

    return {
        "config": {
            "scrape_seconds": args.scrape_seconds,
            "interval_seconds": interval_seconds,
            "scrape_plus_interval_s": unit,
            "concurrency": args.concurrency,
            "down_stabilization_seconds": args.down_stabilization_seconds,
            "operator_base_tick_seconds": defaults.AUTOSCALER_BASE_TICK_SECONDS,
            "operator_smoothing_window_seconds": defaults.SIGNAL_WINDOW_SECONDS,
            "operator_assumed_scrape_seconds": defaults.SCRAPE_INTERVAL_SECONDS,
        },
        "reaction": figure("load_step_to_replicas_write_s"),
        "new_pod_ready": figure("load_step_to_new_pod_ready_s"),
        "first_scale_down": figure("load_drop_to_first_scale_down_s"),
        "back_at_min": figure("load_drop_to_min_replicas_s"),
        "trials": trials,
        "hpa_cpu_rule": HPA_NOTE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--scrape-seconds", type=float, default=2.0, help="Prometheus scrape interval")
    parser.add_argument("--interval", default="5s", help="spec.autoscaling.interval")
    parser.add_argument("--down-stabilization-seconds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=24, help="streams after the step")
    parser.add_argument("--trials", type=int, default=1)
    result = run(parser.parse_args())
    print(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "autoscaler_reaction_e2e.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
