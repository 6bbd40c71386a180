"""parallelism.tensor: every size of the capabilities table is accepted with a matching GPU
count and reaches the pods as --tensor-parallel-size with the GPUs and a memory-backed
/dev/shm; a draft model is refused with tensor parallelism on the pools that speculate (the
runtime refuses it at start-up), by the pydantic models and by a CEL rule with the same
message; pipeline parallelism stays refused."""

from __future__ import annotations

import argparse
from typing import Any

import crdgen
import pytest

import splitserve_contract as contract
from splitserve_contract import capabilities as caps
from splitserve_operator import api, render
from splitserve_operator.engines import pod as engine_pod

IMAGE = "registry.example/splitserve:1.2.3"
DRAFT = {"method": "draft", "draftModel": "hf://meta/llama-3-tiny"}


def _spec(
    *, mode: str = "Disaggregated", speculative: dict[str, Any] | None = None, **pools: dict[str, Any]
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"uri": "hf://meta/llama-3-70b"}, "mode": mode}
    names = ("prefill", "decode") if mode == "Disaggregated" else ("aggregated",)
    spec.update({name: pools.get(name, {}) for name in names})
    if speculative is not None:
        spec["engine"] = {"speculative": speculative}
    return spec


def _parse(spec: dict[str, Any]) -> api.InferenceService:
    return api.InferenceService.parse(
        {
            "apiVersion": api.API_VERSION_STRING,
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ns"},
            "spec": spec,
        }
    )


def _errors(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(api.InvalidSpecError) as info:
        _parse(spec)
    return info.value.errors


def _tp(size: int) -> dict[str, Any]:
    return {"resources": {"gpus": size}, "parallelism": {"tensor": size}}


def _deployment(isvc: api.InferenceService, role: str) -> dict[str, Any]:
    children = render.render_children(isvc=isvc, runtime_image=IMAGE, router_service_account="router")
    (found,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"llama-{role}"]
    return found


def _serve_args(deployment: dict[str, Any]) -> contract.ServeArgs:
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert argv[:2] == ["splitserve", "serve"]
    parser = argparse.ArgumentParser()
    contract.add_serve_arguments(parser)
    return contract.serve_args_from_namespace(parser.parse_args(argv[2:]))


# ------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("size", caps.TENSOR_PARALLEL_SIZE.supported)
def test_every_supported_size_reaches_the_pods_with_its_gpus_and_shared_memory(size: int) -> None:
    isvc = _parse(_spec(prefill=_tp(size), decode=_tp(size)))
    for role in ("prefill", "decode"):
        deployment = _deployment(isvc, role)
        args = _serve_args(deployment)
        assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.device) == (size, 1, "cuda")
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"][render.GPU_RESOURCE] == size
        assert container["resources"]["requests"][render.GPU_RESOURCE] == size
        # NCCL and the worker ranks use /dev/shm: a memory-backed volume, not the 64 MiB default.
        (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[shm["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": engine_pod.SHM_SIZE}


def test_every_tensor_size_is_served_and_unserved_pipeline_sizes_are_refused() -> None:
    assert caps.TENSOR_PARALLEL_SIZE.supported == caps.TENSOR_PARALLEL_SIZE.known == (1, 2, 4, 8)
    refused = (
        [caps.PIPELINE_PARALLEL_SIZE]
        if caps.PIPELINE_PARALLEL_SIZE.supported != caps.PIPELINE_PARALLEL_SIZE.known
        else []
    )
    assert [caps.cel_rule(c) for c in refused] == list(api.PARALLELISM_CEL_RULES)  # no rule for tensor any more
    for stages in (v for v in caps.PIPELINE_PARALLEL_SIZE.known if not caps.PIPELINE_PARALLEL_SIZE.is_supported(v)):
        assert _errors(
            _spec(decode={"resources": {"gpus": 8 - 8 % int(stages)}, "parallelism": {"pipeline": stages}})
        ) == [f"spec.decode.parallelism.pipeline: {caps.PIPELINE_PARALLEL_SIZE.unsupported_message(stages)}"]


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        ({"resources": {"gpus": 2}, "parallelism": {"tensor": 4}}, api.PARALLELISM_RULE_MESSAGE),
        ({"resources": {"gpus": 6}, "parallelism": {"tensor": 4}}, api.PARALLELISM_RULE_MESSAGE),
        ({"resources": {"gpus": 0}, "parallelism": {"tensor": 2}}, api.CPU_PARALLELISM_RULE_MESSAGE),
    ],
)
def test_a_pod_must_hold_whole_tensor_parallel_groups(pool: dict[str, Any], expected: str) -> None:
    assert _errors(_spec(decode=pool)) == [f"spec.decode: {expected}"]


# ------------------------------------------------------------------------------ draft model


@pytest.mark.parametrize(("mode", "pool"), [("Disaggregated", "decode"), ("Aggregated", "aggregated")])
@pytest.mark.parametrize("size", [s for s in caps.TENSOR_PARALLEL_SIZE.supported if s != 1])
def test_a_draft_model_is_refused_on_a_tensor_parallel_pool_that_speculates(mode: str, pool: str, size: int) -> None:
    errors = _errors(_spec(mode=mode, speculative=DRAFT, **{pool: _tp(size)}))
    assert errors == [f"spec: {api.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE} ({pool}.parallelism.tensor {size})"]
    assert "not supported with tensor or pipeline parallelism yet (ngram is)" in api.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE


def test_a_tensor_parallel_prefill_pool_may_serve_a_draft_speculating_decode_pool() -> None:
    isvc = _parse(_spec(speculative=DRAFT, prefill=_tp(4)))
    prefill = _serve_args(_deployment(isvc, "prefill"))
    decode = _serve_args(_deployment(isvc, "decode"))
    assert (prefill.tensor_parallel_size, prefill.speculative_method) == (4, "none")  # prefill never speculates
    assert (decode.tensor_parallel_size, decode.speculative_method) == (1, "draft")


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_other_methods_speculate_with_tensor_parallelism(method: str) -> None:
    isvc = _parse(_spec(speculative={"method": method}, decode=_tp(8)))
    decode = _serve_args(_deployment(isvc, "decode"))
    assert (decode.tensor_parallel_size, decode.speculative_method) == (8, method)


def test_the_crd_refuses_a_draft_model_with_tensor_parallelism_at_the_spec() -> None:
    spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r["message"] == api.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE]
    text = rule["rule"]
    # spec.scheduling's method, else the deprecated spec.engine's
    assert text.startswith("(has(self.scheduling) ? (has(self.scheduling.speculative)")
    assert "self.engine.speculative.method : 'none') : 'none')) != 'draft'" in text
    for pool in api.SPECULATING_POOLS:
        assert f"self.{pool}.parallelism.tensor == 1" in text
    assert "self.prefill" not in text  # prefill pods never get the draft model
    assert f"- {api.DRAFT_TENSOR_PARALLEL_RULE_MESSAGE}" in crdgen.api_reference()
