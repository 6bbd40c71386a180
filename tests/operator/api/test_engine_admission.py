"""``spec.runtime.engine`` at admission, on a real kube-apiserver and in the models: what the
vLLM engine does not serve is refused with the engine named, the same words from CEL and from
pydantic; what it serves is admitted; the engine cannot change; objects written with the
deprecated ``spec.engine`` keep working.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import crdgen
import pydantic
import pytest
from autoscaler_testing import BareApiserver, bare_apiserver, create_inference_service
from kubernetes import client as k8s

import splitserve_contract as contract
from splitserve_operator import api

NAMESPACE = "default"
VLLM = {"engine": "vllm"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BareApiserver]:
    with bare_apiserver(tmp_path_factory.mktemp("engine-apiserver")) as running:
        k8s.ApiextensionsV1Api(running.api_client).create_custom_resource_definition(crdgen.crd())  # type: ignore[arg-type]  # the client takes the plain dict too
        yield running


def _spec(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "Aggregated",
        "model": {"uri": "hf://org/model"},
        "aggregated": {"resources": {"gpus": 1}},
        "runtime": dict(VLLM),
    }
    return {**copy.deepcopy(base), **spec}


def _obj(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION_STRING, "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


def _objects(server: BareApiserver) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(server.api_client)


def _model_error(spec: dict[str, Any]) -> str | None:
    try:
        api.InferenceServiceSpec.model_validate(spec)
    except pydantic.ValidationError as exc:
        return str(exc)
    return None


REFUSED = [
    (
        {"model": {"uri": "hf://org/model", "quantization": "int8"}},
        "quantization int8 is not supported by engine vllm (supported: none, fp8)",
    ),
    (
        {"model": {"uri": "hf://org/model", "quantization": "int4"}},
        "quantization int4 is not supported by engine vllm",
    ),
    ({"router": {"mode": "InferencePool"}}, "router.mode InferencePool is not supported by engine vllm"),
    (
        {"aggregated": {"resources": {"gpus": 16, "gpusPerNode": 8}, "parallelism": {"tensor": 8, "pipeline": 2}}},
        "replica layout multi-node is not supported by engine vllm (supported: single-node)",
    ),
    ({"model": {"uri": "hf://org/model/model-q4_0.gguf"}}, "a .gguf model file is not supported by engine vllm"),
    (
        {"scheduling": {"speculative": {"method": "ngram", "maxNumSeqs": 8}}},
        "scheduling.speculative.maxNumSeqs is not supported by engine vllm",
    ),
    ({"runtime": {**VLLM, "extraArgs": ["--api_key=stolen"]}}, "the operator renders for engine vllm"),
    ({"runtime": {**VLLM, "extraArgs": ["--api-ke", "x"]}}, "the operator renders for engine vllm"),
    ({"runtime": {**VLLM, "extraArgs": ["-tp=4"]}}, "the operator renders for engine vllm"),
    ({"runtime": {**VLLM, "extraArgs": ["-qfp8"]}}, "the operator renders for engine vllm"),
    (
        {"runtime": {**VLLM, "extraArgs": ["--speculative-config.method", "ngram"]}},
        "the operator renders for engine vllm",
    ),
    (
        {"aggregated": {"resources": {"gpus": 1}, "extraArgs": ["--kv_transfer_config={}"]}},
        "the operator renders for engine vllm",
    ),
    ({"runtime": {**VLLM, "env": [{"name": "VLLM_API_KEY", "value": "x"}]}}, "VLLM_API_KEY"),
    (
        {"autoscaling": {"slo": {"ttftP99": "2s", "itlP99": "100ms"}}},
        "autoscaling.slo is not supported by engine vllm yet",
    ),
    (
        {"autoscaling": {"prefill": {"targetPromptTokensWaiting": 4096}}},
        "autoscaling.prefill.targetPromptTokensWaiting is not supported by engine vllm",
    ),
]


@pytest.mark.parametrize(("change", "words"), REFUSED)
def test_what_vllm_does_not_serve_is_refused_naming_the_engine(
    server: BareApiserver, change: dict[str, Any], words: str
) -> None:
    spec = {k: v for k, v in _spec(**change).items() if v is not None}
    message = create_inference_service(
        server, _obj(f"refused-{abs(hash(json.dumps(change, sort_keys=True))) % 10**8}", spec)
    )
    assert message is not None and words in message, message
    model_message = _model_error(spec)
    assert model_message is not None and words in model_message, model_message


@pytest.mark.parametrize(("change", "words"), REFUSED[:7])
def test_the_same_values_serve_with_the_bundled_runtime(
    server: BareApiserver, change: dict[str, Any], words: str
) -> None:
    del words
    spec = {k: v for k, v in _spec(**change).items() if v is not None}
    spec["runtime"] = {}
    if spec["model"]["uri"].endswith(".gguf") or spec.get("router", {}).get("mode") == "InferencePool":
        return  # a hub endpoint or the operator's InferencePool flag decide those, not the engine
    assert _model_error(spec) is None
    assert (
        create_inference_service(server, _obj(f"bundled-{abs(hash(json.dumps(change, sort_keys=True))) % 10**8}", spec))
        is None
    )


def test_what_vllm_serves_is_admitted(server: BareApiserver) -> None:
    spec = _spec(
        model={"uri": "hf://org/model", "quantization": "fp8", "dtype": "bfloat16", "maxModelLen": 4096},
        kvCache={"dtype": "fp8", "prefixCaching": False},
        scheduling={"maxNumSeqs": 64, "speculative": {"method": "ngram", "numTokens": 4}},
        aggregated={
            "resources": {"gpus": 2},
            "parallelism": {"tensor": 2},
            "scheduling": {"maxBatchedTokens": 16384},
            "extraArgs": ["--enforce-eager", "--max-loras", "2", "-O3", "--model-impl", "vllm"],
        },
        runtime={
            **VLLM,
            "extraArgs": ["--disable-log-requests"],
            "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
        },
    )
    assert _model_error(spec) is None
    assert create_inference_service(server, _obj("vllm-friendly", spec)) is None


def test_disaggregated_vllm_is_admitted(server: BareApiserver) -> None:
    """Prefill and decode vLLM pools (NixlConnector), each with its own scheduling."""
    spec = _spec(
        mode="Disaggregated",
        aggregated=None,
        prefill={"resources": {"gpus": 1}, "scheduling": {"maxBatchedTokens": 16384}},
        decode={"resources": {"gpus": 1}, "scheduling": {"maxNumSeqs": 256}},
    )
    spec.pop("aggregated")
    assert _model_error(spec) is None
    assert create_inference_service(server, _obj("vllm-disaggregated", spec)) is None


def test_the_engine_cannot_change(server: BareApiserver) -> None:
    assert create_inference_service(server, _obj("engine-change", _spec())) is None
    objects = _objects(server)
    live: dict[str, Any] = objects.get_namespaced_custom_object(  # type: ignore[assignment]
        contract.API_GROUP, contract.API_VERSION, NAMESPACE, contract.PLURAL, "engine-change"
    )
    assert live["spec"]["runtime"]["engine"] == "vllm"
    live["spec"]["runtime"]["engine"] = "splitserve"
    with pytest.raises(k8s.ApiException) as refused:
        objects.replace_namespaced_custom_object(
            contract.API_GROUP, contract.API_VERSION, NAMESPACE, contract.PLURAL, "engine-change", live
        )
    message = str(json.loads(refused.value.body or "{}").get("message"))
    assert refused.value.status == 422 and api.ENGINE_IMMUTABLE_RULE_MESSAGE in message, message


def test_the_engine_defaults_to_the_bundled_runtime(server: BareApiserver) -> None:
    spec = _spec(runtime={})
    assert create_inference_service(server, _obj("engine-default", spec)) is None
    live: dict[str, Any] = _objects(server).get_namespaced_custom_object(  # type: ignore[assignment]
        contract.API_GROUP, contract.API_VERSION, NAMESPACE, contract.PLURAL, "engine-default"
    )
    assert live["spec"]["runtime"]["engine"] == "splitserve"
    assert api.InferenceServiceSpec.model_validate(spec).runtime.engine == "splitserve"


def test_the_deprecated_engine_field_still_admits_and_applies() -> None:
    """Objects written before spec.engine became spec.scheduling keep their settings; when both
    are set (a manifest moved to the new name over a stored default), spec.scheduling wins."""
    old = api.InferenceServiceSpec.model_validate(
        _spec(runtime={}, engine={"maxNumSeqs": 7, "speculative": {"method": "ngram"}})
    )
    assert old.scheduling_settings.max_num_seqs == 7
    assert old.scheduling_settings.speculative.method == "ngram"
    both = api.InferenceServiceSpec.model_validate(
        _spec(runtime={}, engine={"maxNumSeqs": 7}, scheduling={"maxNumSeqs": 9})
    )
    assert both.scheduling_settings.max_num_seqs == 9


def test_a_pool_overrides_the_service_scheduling_field_by_field() -> None:
    spec = api.InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/model"},
            "scheduling": {"maxNumSeqs": 32, "maxBatchedTokens": 4096, "chunkedPrefill": True},
            "prefill": {"scheduling": {"maxBatchedTokens": 16384}},
            "decode": {"scheduling": {"maxNumSeqs": 256, "chunkedPrefill": False}},
        }
    )
    assert spec.prefill is not None and spec.decode is not None
    prefill, decode = spec.pool_scheduling(spec.prefill), spec.pool_scheduling(spec.decode)
    assert (prefill.max_num_seqs, prefill.max_batched_tokens, prefill.chunked_prefill) == (32, 16384, True)
    assert (decode.max_num_seqs, decode.max_batched_tokens, decode.chunked_prefill) == (256, 4096, False)
