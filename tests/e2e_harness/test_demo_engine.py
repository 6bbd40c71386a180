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
    assert (config.concurrency, config.duration_seconds) == (24, 60.0)
    assert config.served_name == "tiny-llama"


def test_vllm_runs_smollm2_aggregated_with_a_longer_smaller_burst() -> None:
    config = demo.demo_config(_args(engine="vllm"))
    assert (config.mode, config.name, config.served_name) == ("Aggregated", "smollm2", "smollm2")
    assert (config.concurrency, config.duration_seconds) == (8, 240.0)
    given = demo.demo_config(_args(engine="vllm", mode="Aggregated", concurrency=4, duration_seconds=30.0))
    assert (given.concurrency, given.duration_seconds) == (4, 30.0)


def test_vllm_refuses_disaggregated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="Aggregated only"):
        demo.demo_config(_args(engine="vllm", mode="Disaggregated"))
    with pytest.raises(SystemExit) as exited:
        demo.main(["--engine", "vllm", "--mode", "Disaggregated"])
    assert exited.value.code == 2
    assert "Aggregated only" in capsys.readouterr().err


def test_the_table_reads_each_engines_own_series() -> None:
    queue, kv = demo.pool_queries(namespace="ns", name="smollm2", engine="vllm")
    assert queue == f'sum by (role) ({VLLM_METRICS.requests_waiting}{{namespace="ns",inferenceservice="smollm2"}})'
    assert kv == f'avg by (role) ({VLLM_METRICS.kv_cache_usage_ratio}{{namespace="ns",inferenceservice="smollm2"}})'
    assert queue.startswith("sum by (role) (vllm:num_requests_waiting{")
    queue, kv = demo.pool_queries(namespace="ns", name="tiny")
    assert SPLITSERVE_METRICS.requests_waiting in queue and SPLITSERVE_METRICS.kv_cache_usage_ratio in kv


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
