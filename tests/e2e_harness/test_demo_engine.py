"""``make demo DEMO_ARGS="--engine vllm"``: the choices the demo makes before any cluster
exists (its options per engine, the vLLM InferenceService it applies, the PromQL of its table),
checked without a cluster. The run itself is ``make demo`` on the local cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitserve_contract.engine_metrics import SPLITSERVE_METRICS, VLLM_METRICS
from splitserve_e2e import demo
from splitserve_e2e.stack import ModelHub, isvc_manifest
from splitserve_operator.api.resource import InferenceService

HUB = ModelHub(endpoint="http://10.88.0.1:8765", token="hf_test")


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "engine": "splitserve",
        "mode": None,
        "duration_seconds": None,
        "concurrency": None,
        "extend_seconds": None,
        "idle_seconds": 120.0,
        "baseline_seconds": 10.0,
        "out": Path("out/demo"),
        "chat": True,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_default_demo_is_unchanged() -> None:
    config = demo.demo_config(_args())
    assert (config.engine, config.mode, config.name) == ("splitserve", "Disaggregated", "tiny")
    assert (config.concurrency, config.duration_seconds, config.extend_seconds) == (24, 60.0, 0.0)
    assert config.served_name == "tiny-llama"


def test_vllm_runs_smollm2_aggregated_with_a_longer_smaller_burst() -> None:
    config = demo.demo_config(_args(engine="vllm"))
    assert (config.mode, config.name, config.served_name) == ("Aggregated", "smollm2", "smollm2")
    assert (config.concurrency, config.duration_seconds, config.extend_seconds) == (8, 240.0, 600.0)
    given = demo.demo_config(
        _args(engine="vllm", mode="Aggregated", concurrency=4, duration_seconds=30.0, extend_seconds=0.0)
    )
    assert (given.concurrency, given.duration_seconds, given.extend_seconds) == (4, 30.0, 0.0)


def test_the_burst_goes_on_while_the_scale_up_is_starting() -> None:
    def end(
        *, now: float = 247.0, scaled: bool = True, starting: bool = False, ready_since: float | None = None
    ) -> float:
        return demo.burst_end(
            nominal_end=250.0,
            cap_end=850.0,
            now=now,
            scaled=scaled,
            starting=starting,
            ready_since=ready_since,
            serve_seconds=45.0,
        )

    assert end(scaled=False, starting=True) == 250.0  # no scale-up: the burst as asked
    assert end(starting=True) == 247.0 + 45.0  # the new pod is starting: a little longer each sample
    assert end(starting=True, now=840.0) == 850.0  # never past the cap
    assert end(ready_since=280.0) == 325.0  # Ready at 280: served 45 s, then the burst ends
    assert end(ready_since=150.0) == 250.0  # Ready long before the end: the burst as asked


def test_vllm_refuses_disaggregated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="Aggregated only"):
        demo.demo_config(_args(engine="vllm", mode="Disaggregated"))
    with pytest.raises(SystemExit) as exited:
        demo.main(["--engine", "vllm", "--mode", "Disaggregated"])
    assert exited.value.code == 2
    assert "Aggregated only" in capsys.readouterr().err


def test_the_table_reads_each_engines_own_series() -> None:
    queue, kv = demo.pool_queries(namespace="ns", name="tiny")
    assert queue == f'sum by (role) ({SPLITSERVE_METRICS.requests_waiting}{{namespace="ns",inferenceservice="tiny"}})'
    assert kv == f'avg by (role) ({SPLITSERVE_METRICS.kv_cache_usage_ratio}{{namespace="ns",inferenceservice="tiny"}})'
    # vLLM's series carry no role label: the pool is its Deployment's pods, labelled here
    queue, kv = demo.pool_queries(namespace="ns", name="smollm2", engine="vllm", roles=("aggregated",))
    pool = 'namespace="ns",inferenceservice="smollm2",pod=~"smollm2-engine-.+"'
    assert queue == (
        f'sum by (role) (label_replace({VLLM_METRICS.requests_waiting}{{{pool}}}, "role", "aggregated", "", ""))'
    )
    assert kv == (
        f'avg by (role) (label_replace({VLLM_METRICS.kv_cache_usage_ratio}{{{pool}}}, "role", "aggregated", "", ""))'
    )
    assert queue.startswith("sum by (role) (label_replace(vllm:num_requests_waiting{")


def test_the_vllm_manifest_is_a_valid_vllm_service() -> None:
    body = demo.vllm_manifest(name=demo.VLLM_NAME, namespace="splitserve-demo", hub=HUB)
    parsed = InferenceService.parse(body)
    assert parsed.spec.runtime.engine.value == "vllm"
    assert parsed.spec.mode.value == "Aggregated"
    spec = body["spec"]
    assert spec["model"]["uri"] == f"hf://{demo.VLLM_REPO_ID}"
    assert spec["model"]["servedName"] == demo.VLLM_SERVED_NAME == "smollm2"
    assert spec["model"]["hubTokenSecretRef"] == {"name": HUB.token_secret}
    assert spec["aggregated"]["replicas"] == {"min": 1, "max": 2}
    assert spec["aggregated"]["scheduling"]["maxNumSeqs"] < demo.ENGINE_DEFAULTS["vllm"]["concurrency"]
    # the tiny service of the default demo still validates too
    InferenceService.parse(isvc_manifest(name="tiny", namespace="splitserve-demo", mode="Disaggregated", hub=HUB))
