"""The InferenceService models: examples parse, defaults match the design, invalid specs
fail with messages a user can act on, and the helpers name and label children right."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

import splitserve_contract as contract
from splitserve_operator import api, naming

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _minimal(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "prefill": {}, "decode": {}}
    body.update(spec)
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": body,
    }


def _errors(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(api.InvalidSpecError) as info:
        api.InferenceService.parse(obj)
    return info.value.errors


def test_examples_exist_and_parse() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"disaggregated.yaml", "aggregated.yaml", "tiny-disaggregated.yaml", "tiny-aggregated.yaml"} <= names
    for path in EXAMPLES:
        isvc = api.InferenceService.parse(yaml.safe_load(path.read_text()))
        assert isvc.spec.model.uri.startswith(("hf://", "pvc://", "file://")), path


def test_tiny_examples_run_on_cpu_on_any_node() -> None:
    for name in ("tiny-disaggregated.yaml", "tiny-aggregated.yaml"):
        spec = api.InferenceService.parse(yaml.safe_load((REPO / "examples" / name).read_text())).spec
        assert spec.model.uri == "hf://splitserve/tiny-llama"
        assert spec.model.hub_endpoint == "http://10.213.0.1:8765"  # the kubelet node's gateway
        assert spec.runtime.extra_args[:2] == ["--device", "cpu"]
        for role in api.pool_names(spec):
            assert not api.pool_spec(spec, role).node_selector


def test_defaults_match_the_design() -> None:
    spec = api.InferenceService.parse(_minimal()).spec
    assert spec.mode is api.Mode.DISAGGREGATED
    assert spec.prefill is not None and spec.prefill.replicas.min == 1 and spec.prefill.replicas.max == 4
    assert spec.prefill.resources.gpus == 1
    assert (spec.prefill.parallelism.tensor, spec.prefill.parallelism.pipeline) == (1, 1)
    assert spec.router.policy is contract.RoutingPolicy.PREFIX_AFFINITY
    assert spec.router.session_header == "x-session-id"
    assert spec.router.short_prompt_threshold == 64
    assert (spec.kv_cache.block_size, spec.kv_cache.memory_fraction, spec.kv_cache.prefix_caching) == (16, 0.9, True)
    settings = spec.scheduling_settings
    assert (settings.max_num_seqs, settings.max_batched_tokens, settings.chunked_prefill) == (256, 8192, True)
    auto = spec.autoscaling
    assert auto.enabled and not auto.dry_run and auto.interval_seconds == 15.0
    assert auto.prefill.target_queue_depth == 4 and auto.prefill.target_prompt_tokens_waiting is None
    assert auto.decode.target_kv_cache_utilization == 0.8 and auto.decode.target_queue_depth == 2
    assert auto.behavior.scale_up.stabilization_seconds == 0
    assert auto.behavior.scale_up.max_step_percent == 100
    assert auto.behavior.scale_down.stabilization_seconds == 300
    assert auto.behavior.scale_down.max_step == 1
    assert auto.tolerance == 0.1 and auto.gpu_budget is None


def test_dump_uses_camel_case_and_round_trips() -> None:
    obj = _minimal(autoscaling={"decode": {"targetKVCacheUtilization": 0.5}, "gpuBudget": 8})
    isvc = api.InferenceService.parse(obj)
    dumped = isvc.dump()
    assert dumped["spec"]["autoscaling"]["decode"]["targetKVCacheUtilization"] == 0.5
    assert dumped["spec"]["kvCache"]["blockSize"] == 16
    assert "kv_cache" not in dumped["spec"]
    assert api.InferenceService.parse(dumped) == isvc


def test_snake_case_names_are_accepted_too() -> None:
    spec = api.InferenceServiceSpec(
        model=api.ModelSpec(uri="file:///models/x", max_model_len=128),
        mode=api.Mode.AGGREGATED,
        aggregated=api.PoolSpec(resources=api.ResourcesSpec(gpus=0)),
    )
    assert api.pool_names(spec) == ["aggregated"]
    assert spec.dump()["model"]["maxModelLen"] == 128


def test_quantities_accept_yaml_integers() -> None:
    isvc = api.InferenceService.parse(_minimal(prefill={"resources": {"cpu": 4, "memory": "16Gi"}}))
    assert isvc.spec.prefill is not None and isvc.spec.prefill.resources.cpu == "4"
    errors = _errors(_minimal(prefill={"resources": {"memory": "lots"}}))
    assert errors == [
        "spec.prefill.resources.memory: must be a non-negative Kubernetes quantity such as 2, 500m or 16Gi, got 'lots'"
    ]


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (
            {"prefill": {"replicas": {"min": 5, "max": 2}}},
            "spec.prefill.replicas: replicas.min must be less than or equal to replicas.max",
        ),
        ({"decode": None}, "spec: mode Disaggregated requires spec.prefill and spec.decode"),
        ({"aggregated": {}}, "forbids spec.aggregated"),
        ({"mode": "Aggregated"}, "spec: mode Aggregated requires spec.aggregated"),
        ({"mode": "Sideways"}, "spec.mode: Input should be 'Disaggregated' or 'Aggregated'"),
        (
            {"model": {"uri": "s3://bucket/model"}},
            "spec.model.uri: must be hf://org/name, hf://org/name/file.gguf, pvc://claim/path or file:///absolute/path (path segments of printable ASCII, none '.', '..' or empty), got 's3://bucket/model'",
        ),
        (
            {"model": {"uri": "hf://org/name/model.safetensors"}},
            "spec.model.uri: must be hf://org/name, hf://org/name/file.gguf",
        ),
        ({"model": {}}, "spec.model.uri: Field required"),
        (
            {"prefill": {"resources": {"gpus": 2}, "parallelism": {"tensor": 4}}},
            "spec.prefill: resources.gpus must be a multiple of parallelism.tensor * parallelism.pipeline",
        ),
        (
            {"prefill": {"resources": {"gpus": 0}, "parallelism": {"tensor": 2}}},
            "spec.prefill: resources.gpus 0 (CPU) requires parallelism.tensor 1 and parallelism.pipeline 1",
        ),
        (
            {"prefill": {"parallelism": {"pipeline": 2}}},
            "spec.prefill: resources.gpus must be a multiple of parallelism.tensor * parallelism.pipeline",
        ),
        (
            {
                "decode": {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}},
                "engine": {"speculative": {"method": "draft", "draftModel": "hf://org/small"}},
            },
            f"spec: {api.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE} (decode.parallelism.tensor 2)",
        ),
        (
            {"model": {"uri": "hf://a/b", "quantization": "fp4"}},
            "spec.model.quantization: Input should be none, fp8, int8 or int4",
        ),
        (
            {"model": {"uri": "hf://a/b", "hubEndpoint": "ftp://mirror"}},
            "spec.model.hubEndpoint: must be an http:// or https:// URL",
        ),
        (
            {"model": {"uri": "hf://a/b", "hubEndpoint": "https://mirror/x?token=1"}},
            "spec.model.hubEndpoint: must be an http:// or https:// URL",
        ),
        ({"decode": {"parallelism": {"tensor": 3}}}, "spec.decode.parallelism.tensor: Input should be 1, 2, 4 or 8"),
        ({"kvCache": {"blockSize": 24}}, "spec.kvCache.blockSize: Input should be 8, 16, 32, 64 or 128"),
        ({"kvCache": {"dtype": "float16"}}, "spec.kvCache.dtype: Input should be auto or fp8"),
        (
            {"kvCache": {"memoryFraction": 0.99}},
            "spec.kvCache.memoryFraction: Input should be less than or equal to 0.98",
        ),
        ({"kvCache": {"memoryFraction": 0}}, "spec.kvCache.memoryFraction: Input should be greater than 0"),
        ({"autoscaling": {"interval": "0s"}}, "spec.autoscaling: autoscaling.interval must be between 1s and 24h"),
        ({"autoscaling": {"interval": "500ms"}}, "spec.autoscaling: autoscaling.interval must be between 1s and 24h"),
        ({"autoscaling": {"interval": "15"}}, "spec.autoscaling.interval: must be a duration such as 15s"),
        (
            {"autoscaling": {"behavior": {"scaleUp": {"maxStepPercent": 0}}}},
            "spec.autoscaling.behavior.scaleUp.maxStepPercent: Input should be greater than or equal to 1",
        ),
        (
            {"autoscaling": {"decode": {"targetKVCacheUtilization": 1.5}}},
            "spec.autoscaling.decode.targetKVCacheUtilization: Input should be less than or equal to 1",
        ),
        (
            {"autoscaling": {"gpuBudget": 1}},
            "spec: autoscaling.gpuBudget must be at least the sum over pools of replicas.min * resources.gpus (budget 1, minimum use 2)",
        ),
        (
            {"runtime": {"env": [{"name": "1BAD"}]}},
            "spec.runtime.env[0].name: must be a valid environment variable name",
        ),
        ({"router": {"polcy": "RoundRobin"}}, "spec.router.polcy: unknown field"),
    ],
)
def test_invalid_specs_have_readable_errors(patch: dict[str, Any], expected: str) -> None:
    obj = _minimal()
    for key, value in patch.items():
        if value is None:
            obj["spec"].pop(key)
        else:
            obj["spec"][key] = value
    errors = _errors(obj)
    assert any(expected in line for line in errors), errors


def test_error_message_names_the_object() -> None:
    with pytest.raises(api.InvalidSpecError, match=r"^InferenceService ns/demo is invalid: spec\.model\.uri"):
        api.InferenceService.parse(_minimal(model={"uri": "http://x"}))


def test_gpu_budget_counts_only_present_pools_and_gpus() -> None:
    obj = _minimal(
        prefill={"replicas": {"min": 2, "max": 4}, "resources": {"gpus": 2}},
        decode={"replicas": {"min": 3, "max": 4}, "resources": {"gpus": 0}},
        autoscaling={"gpuBudget": 4},
    )
    assert api.InferenceService.parse(obj).spec.autoscaling.gpu_budget == 4
    obj["spec"]["autoscaling"]["gpuBudget"] = 3
    assert any("minimum use 4" in line for line in _errors(obj))


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("a" * 41, "at most 40 characters"), ("Demo", "DNS-1035"), ("1demo", "DNS-1035"), ("demo.x", "DNS-1035")],
)
def test_metadata_name_rules(name: str, fragment: str) -> None:
    obj = _minimal()
    obj["metadata"]["name"] = name
    assert any(fragment in line for line in _errors(obj))
    obj["metadata"]["name"] = "a" * 40
    api.InferenceService.parse(obj)


def test_parse_accepts_read_only_mapping_views() -> None:
    from types import MappingProxyType

    obj = _minimal()
    obj["spec"] = MappingProxyType(obj["spec"])
    assert api.InferenceService.parse(MappingProxyType(obj)).metadata.name == "demo"
    assert api.InferenceService.parse_spec(obj["spec"]).mode is api.Mode.DISAGGREGATED
    with pytest.raises(api.InvalidSpecError, match=r"spec\.mode"):
        api.InferenceService.parse_spec({**obj["spec"], "mode": "x"})


def test_status_round_trip_and_summary() -> None:
    now = api.utc_now()
    status = api.InferenceServiceStatus(
        observed_generation=3,
        conditions=[
            api.Condition(
                type="Ready",
                status=api.ConditionStatus.FALSE,
                reason=api.Reason.NAME_CONFLICT,
                message="Deployment demo-prefill exists and is not ours",
                last_transition_time=now,
                observed_generation=3,
            ),
        ],
        prefill=api.PoolStatus(replicas=2, ready_replicas=1, desired_replicas=3),
        decode=api.PoolStatus(replicas=2, ready_replicas=2),
        scaling_history=[api.ScalingEvent(time=now, pool="decode", from_replicas=1, to_replicas=2, reason="ScaledUp")],
    )
    dumped = status.dump()
    assert dumped["prefill"]["summary"] == "1/3"
    assert dumped["decode"]["summary"] == "2/2"
    assert dumped["scalingHistory"][0]["from"] == 1 and dumped["scalingHistory"][0]["to"] == 2
    assert dumped["conditions"][0]["lastTransitionTime"].endswith("Z")
    again = api.InferenceServiceStatus.model_validate(dumped)
    assert again == status
    cond = again.condition(api.ConditionType.READY)
    assert cond is not None and cond.reason == "NameConflict"
    assert again.condition("Stalled") is None


def test_status_history_is_bounded() -> None:
    event = {"time": "2026-01-01T00:00:00Z", "pool": "prefill", "from": 1, "to": 2, "reason": "ScaledUp"}
    api.InferenceServiceStatus.model_validate({"scalingHistory": [event] * api.MAX_SCALING_HISTORY})
    with pytest.raises(ValueError, match="at most 20 items"):
        api.InferenceServiceStatus.model_validate({"scalingHistory": [event] * (api.MAX_SCALING_HISTORY + 1)})


@pytest.mark.parametrize(
    ("text", "seconds"), [("15s", 15.0), ("1m30s", 90.0), ("500ms", 0.5), ("2h", 7200.0), ("1.5m", 90.0)]
)
def test_durations(text: str, seconds: float) -> None:
    assert api.parse_duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "15", "s", "1d", "-1s", "1 s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        api.parse_duration_seconds(text)


def test_pool_names_and_pool_spec() -> None:
    spec = api.InferenceService.parse(_minimal()).spec
    assert api.pool_names(spec) == ["prefill", "decode"]
    assert api.pool_spec(spec, contract.Role.DECODE) is spec.decode
    with pytest.raises(ValueError, match="mode Disaggregated has no aggregated pool"):
        api.pool_spec(spec, "aggregated")


def test_child_names_and_labels() -> None:
    assert api.child_name("demo", "prefill") == "demo-prefill"
    assert naming.child_name("demo", contract.Role.DECODE) == "demo-decode"
    assert naming.child_name("demo", "router") == "demo-router"
    assert naming.child_name("demo", "aggregated") == "demo-engine"
    assert naming.config_map_name("demo") == "demo-config"
    with pytest.raises(ValueError):
        naming.child_name("demo", "sidecar")
    longest = "a" * naming.MAX_NAME_LENGTH
    for role in contract.Role:
        assert len(naming.child_name(longest, role)) <= 48
    labels = naming.labels("demo", "decode", compat_hash="abc")
    assert labels == {
        contract.LABEL_NAME: "splitserve",
        contract.LABEL_INSTANCE: "demo",
        contract.LABEL_COMPONENT: "decode",
        contract.LABEL_MANAGED_BY: "splitserve-operator",
        contract.LABEL_ROLE: "decode",
        contract.LABEL_SCRAPE: "true",
        contract.LABEL_COMPAT_HASH: "abc",
    }
    assert contract.LABEL_COMPAT_HASH not in naming.labels("demo", "router", compat_hash="abc")
    selector = naming.selector_labels("demo", "decode")
    assert selector.items() <= labels.items() and contract.LABEL_COMPAT_HASH not in selector


def test_compat_hash_is_short_stable_and_sensitive() -> None:
    base: dict[str, Any] = {
        "image": "img:1",
        "model_uri": "hf://a/b",
        "revision": None,
        "dtype": "auto",
        "quantization": "none",
        "block_size": 16,
    }
    first = naming.compat_hash(**base)
    assert len(first) == 10 and all(c in "0123456789abcdef" for c in first)
    assert naming.compat_hash(**copy.deepcopy(base)) == first
    assert naming.compat_hash(**{**base, "revision": ""}) == first
    for key, other in [
        ("image", "img:2"),
        ("model_uri", "hf://a/c"),
        ("revision", "v2"),
        ("dtype", "bfloat16"),
        ("quantization", "fp8"),
        ("block_size", 32),
        ("kv_cache_dtype", "fp8"),
    ]:
        assert naming.compat_hash(**{**base, key: other}) != first, key
    # auto (the activation dtype) leaves the hash as it was before kvCache.dtype existed
    assert naming.compat_hash(**base, kv_cache_dtype="auto") == first == "5afae15865"  # the pre-field value


def test_kv_cache_dtype_defaults_to_auto_and_accepts_fp8() -> None:
    assert api.InferenceService.parse(_minimal()).spec.kv_cache.dtype == "auto"
    fp8 = api.InferenceService.parse(_minimal(kvCache={"dtype": "fp8"}))
    assert fp8.spec.kv_cache.dtype == "fp8"
    assert fp8.dump()["spec"]["kvCache"]["dtype"] == "fp8"


@pytest.mark.parametrize(
    "uri",
    [
        "hf://org/name",
        "hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_0.gguf",
        "hf://org/name/sub/dir/m.Q4_1.gguf",
        "pvc://models/smol/smol.Q4_1.gguf",
        "file:///models/m.gguf",
    ],
)
def test_model_uris_may_name_a_gguf_file(uri: str) -> None:
    isvc = api.InferenceService.parse(_minimal(model={"uri": uri}))
    assert isvc.spec.model.uri == uri


def test_compat_hash_does_not_depend_on_the_parallel_layout() -> None:
    """KV blocks travel in the whole-model layout, so pools with different tensor- or pipeline-
    parallel sizes pair (a TP 2 prefill pool feeding a TP 1 decode pool)."""
    from splitserve_operator import render

    def hash_of(prefill: dict[str, Any], decode: dict[str, Any]) -> str:
        isvc = api.InferenceService.parse(_minimal(prefill=prefill, decode=decode))
        return render.compat_hash_of(isvc=isvc, runtime_image="img:1")

    single = hash_of({"resources": {"gpus": 1}}, {"resources": {"gpus": 1}})
    assert hash_of({"resources": {"gpus": 2}, "parallelism": {"tensor": 2}}, {"resources": {"gpus": 1}}) == single
    assert (
        hash_of({"resources": {"gpus": 1}}, {"resources": {"gpus": 4}, "parallelism": {"tensor": 2, "pipeline": 2}})
        == single
    )
