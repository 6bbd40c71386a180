"""The autoscaler's pure glue: spec -> policy and targets, pod classification, state and
metric bookkeeping, and the exact apply body the actuator sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from splitserve_operator.api import InferenceService
from splitserve_operator.autoscaler.actuator import deletion_cost, replicas_apply_patch
from splitserve_operator.autoscaler.decision import (
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
)
from splitserve_operator.autoscaler.loop import policy_for
from splitserve_operator.autoscaler.memory import AutoscalerState
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics
from splitserve_operator.autoscaler.observe import classify
from splitserve_operator.autoscaler.signals import Targets

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example(name: str) -> InferenceService:
    return InferenceService.parse(yaml.safe_load((EXAMPLES / name).read_text()))


def test_policy_and_targets_from_the_examples() -> None:
    spec = example("disaggregated.yaml").spec
    policy, targets, gpus = policy_for(spec=spec, pool="prefill")
    assert (policy.min_replicas, policy.max_replicas, gpus) == (1, 4, 1)
    assert targets == Targets(queue_depth=4, prompt_tokens_waiting=16384.0)
    policy, targets, _ = policy_for(spec=spec, pool="decode")
    assert (policy.min_replicas, policy.max_replicas, policy.tolerance) == (2, 8, 0.1)
    assert policy.behavior.scale_down_stabilization_seconds == 300 and policy.behavior.scale_down_max_step == 1
    assert targets == Targets(queue_depth=2, kv_cache_utilization=0.8)
    # Aggregated: queue target from autoscaling.prefill (the example sets 8), KV from decode.
    _, targets, _ = policy_for(spec=example("aggregated.yaml").spec, pool="aggregated")
    assert targets == Targets(queue_depth=8, kv_cache_utilization=0.8)


def pod(
    name: str, *, phase: str, ready: bool = False, unschedulable_gpu: bool = False, terminating: bool = False
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable_gpu:
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        )
    meta: dict[str, Any] = {"name": name}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-02T14:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions}}


def test_pods_are_classified_ready_pending_for_gpus_or_starting() -> None:
    obs = classify(
        pool="decode",
        deployment={"metadata": {"name": "svc-decode"}, "spec": {"replicas": 5}},
        pods=[
            pod("a", phase="Running", ready=True),
            pod("b", phase="Running", ready=True, terminating=True),  # leaving: not capacity
            pod("c", phase="Running", ready=False),  # loading weights
            pod("d", phase="Pending", unschedulable_gpu=True),
            pod("e", phase="Pending"),  # scheduled, pulling the image
        ],
    )
    assert (obs.current_replicas, obs.ready_pod_names, obs.pending_for_gpus, obs.starting) == (5, ["a"], ("d",), 2)


def test_fresh_state_is_conservative_and_forget_bounds_memory() -> None:
    state = AutoscalerState()
    history = state.history(namespace="ns", name="svc", pool="decode", now_seconds=0.0, current_replicas=4)
    assert state.history(namespace="ns", name="svc", pool="decode", now_seconds=99.0, current_replicas=1) is history
    d = decide(
        pool="decode",
        now_seconds=15.0,
        current_replicas=4,
        ready_replicas=4,
        pending_replicas=0,
        signals={"queue": SignalValue(value=0.0, target=2.0)},
        policy=PoolPolicy(min_replicas=1, max_replicas=8),
        history=history,
        gpus_per_replica=1,
    )
    assert (d.result, d.reason) == (4, "Stabilizing")
    assert state.due(namespace="ns", name="svc", now_seconds=0.0, interval_seconds=15.0)
    state.mark_run(namespace="ns", name="svc", now_seconds=0.0)
    assert not state.due(namespace="ns", name="svc", now_seconds=14.0, interval_seconds=15.0)
    assert state.due(namespace="ns", name="svc", now_seconds=15.0, interval_seconds=15.0)
    state.last_recommendation[("ns", "svc", "decode")] = 4
    state.histories[("ns", "other", "decode")] = RecommendationHistory()
    state.forget(namespace="ns", name="svc")
    assert list(state.histories) == [("ns", "other", "decode")]
    assert not state.last_recommendation and not state.last_run_seconds


def test_operator_metrics_are_labelled_and_forgotten() -> None:
    registry = CollectorRegistry()
    metrics = AutoscalerMetrics.create(registry=registry)
    d = decide(
        pool="prefill",
        now_seconds=0.0,
        current_replicas=1,
        ready_replicas=1,
        pending_replicas=0,
        signals={"queue": SignalValue(value=12.0, target=4.0)},
        policy=PoolPolicy(min_replicas=1, max_replicas=4),
        history=RecommendationHistory(),
        gpus_per_replica=1,
    )
    metrics.observe(namespace="ns", name="svc", decision=d)
    labels = {"namespace": "ns", "inferenceservice": "svc", "role": "prefill"}
    assert registry.get_sample_value("splitserve_autoscaler_desired_replicas", labels) == 2
    assert registry.get_sample_value("splitserve_autoscaler_decisions_total", labels | {"direction": "up"}) == 1
    metrics.forget(namespace="ns", name="svc")
    assert registry.get_sample_value("splitserve_autoscaler_desired_replicas", labels) is None
    assert registry.get_sample_value("splitserve_autoscaler_decisions_total", labels | {"direction": "up"}) is None


def test_actuator_sends_only_replicas_and_costs_follow_load() -> None:
    assert replicas_apply_patch(namespace="ns", deployment="svc-decode", replicas=3) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "svc-decode", "namespace": "ns"},
        "spec": {"replicas": 3},
    }
    assert [deletion_cost(requests_in_flight=x) for x in (0.0, 0.5, 3.0, 1e12)] == [0, 50, 300, 2**31 - 1]
