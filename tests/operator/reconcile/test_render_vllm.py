"""Pools of ``runtime.engine: vllm``: every spec field reaches ``vllm serve`` as vLLM's own
option, per pool, inside the same restricted pod as the bundled runtime's; the router keeps
the bundled image and learns the engine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import engines
from splitserve_contract.engines import VLLM_IMAGE
from splitserve_operator import render
from splitserve_operator.api import InferenceService
from splitserve_operator.engines import pod as engine_pod
from splitserve_operator.engines import vllm as engine_vllm

RUNTIME_IMAGE = "registry.example/splitserve:1.2.3"


def _isvc(**spec: Any) -> InferenceService:
    base: dict[str, Any] = {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
        "mode": "Aggregated",
        "aggregated": {"resources": {"gpus": 1}},
        "runtime": {"engine": "vllm"},
    }
    base.update(spec)
    return InferenceService.parse(
        {
            "apiVersion": "splitserve.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "uid-1", "generation": 1},
            "spec": base,
        }
    )


def _deployment(objs: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    (dep,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"chat-{suffix}"]
    return dep


def _container(isvc: InferenceService, suffix: str = "engine", **kw: Any) -> dict[str, Any]:
    objs = render.render_children(isvc=isvc, runtime_image=RUNTIME_IMAGE, router_service_account="", **kw)
    container: dict[str, Any] = _deployment(objs, suffix)["spec"]["template"]["spec"]["containers"][0]
    return container


def _options(args: list[str]) -> dict[str, str]:
    """``--flag value`` and bare ``--flag`` pairs (vLLM takes no ``=`` from us)."""
    out: dict[str, str] = {}
    i = 1  # args[0] is the model
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), args
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[flag] = args[i + 1]
            i += 2
        else:
            out[flag] = ""
            i += 1
    return out


def test_defaults_render_vllm_serve_with_every_mapped_option() -> None:
    container = _container(_isvc())
    assert container["image"] == VLLM_IMAGE
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    assert args[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    options = _options(args)
    assert options == {
        "--served-model-name": "chat",
        "--host": f"$({contract.ENV_POD_IP})",
        "--port": str(contract.HTTP_PORT),
        "--dtype": "auto",
        "--block-size": str(contract.defaults.BLOCK_SIZE),
        "--gpu-memory-utilization": str(contract.defaults.KV_MEMORY_FRACTION),
        "--enable-prefix-caching": "",
        "--kv-cache-dtype": "auto",
        "--max-num-seqs": str(contract.defaults.MAX_NUM_SEQS),
        "--max-num-batched-tokens": str(contract.defaults.MAX_NUM_BATCHED_TOKENS),
        "--enable-chunked-prefill": "",
        "--tensor-parallel-size": "1",
        "--pipeline-parallel-size": "1",
        # vLLM's default (0) aborts in-flight requests on SIGTERM; the pod drains instead
        "--shutdown-timeout": str(int(contract.ServeArgs().drain_timeout_seconds)),
    }


def test_every_spec_field_maps_to_its_vllm_option() -> None:
    isvc = _isvc(
        model={
            "uri": "hf://org/model",
            "revision": "a" * 40,
            "servedName": "public-name",
            "dtype": "bfloat16",
            "quantization": "fp8",
            "maxModelLen": 4096,
        },
        kvCache={"blockSize": 32, "memoryFraction": 0.85, "prefixCaching": False, "dtype": "fp8"},
        scheduling={"maxNumSeqs": 64, "maxBatchedTokens": 2048, "chunkedPrefill": False},
        aggregated={"resources": {"gpus": 4}, "parallelism": {"tensor": 2, "pipeline": 2}},
    )
    args = _container(isvc)["args"]
    assert args[0] == "org/model"
    options = _options(args)
    expected = {
        "--served-model-name": "public-name",
        "--revision": "a" * 40,
        "--dtype": "bfloat16",
        "--quantization": "fp8",
        "--max-model-len": "4096",
        "--block-size": "32",
        "--gpu-memory-utilization": "0.85",
        "--no-enable-prefix-caching": "",
        "--kv-cache-dtype": "fp8",
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "2048",
        "--no-enable-chunked-prefill": "",
        "--tensor-parallel-size": "2",
        "--pipeline-parallel-size": "2",
    }
    assert {k: options.get(k) for k in expected} == expected
    assert "--enable-prefix-caching" not in options and "--enable-chunked-prefill" not in options


def test_a_pool_scheduling_and_extra_args_come_after_the_service_ones() -> None:
    isvc = _isvc(
        scheduling={"maxNumSeqs": 64, "maxBatchedTokens": 2048},
        runtime={"engine": "vllm", "extraArgs": ["--enforce-eager"]},
        aggregated={
            "resources": {"gpus": 1},
            "scheduling": {"maxBatchedTokens": 16384},
            "extraArgs": ["--max-loras", "2"],
        },
    )
    args = _container(isvc)["args"]
    assert args[-3:] == ["--enforce-eager", "--max-loras", "2"]
    options = _options(args[:-3])
    assert options["--max-num-seqs"] == "64" and options["--max-num-batched-tokens"] == "16384"


@pytest.mark.parametrize(
    ("speculative", "config"),
    [
        ({"method": "ngram", "numTokens": 3}, {"method": "ngram", "num_speculative_tokens": 3}),
        (
            {"method": "draft", "draftModel": "hf://org/small", "numTokens": 5},
            {"method": "draft_model", "model": "org/small", "num_speculative_tokens": 5},
        ),
    ],
)
def test_speculative_decoding_is_vllm_speculative_config(speculative: dict[str, Any], config: dict[str, Any]) -> None:
    options = _options(_container(_isvc(scheduling={"speculative": speculative}))["args"])
    assert json.loads(options["--speculative-config"]) == config


def test_model_locations_become_vllm_model_arguments() -> None:
    assert _container(_isvc(model={"uri": "file:///models/llama"}))["args"][0] == "/models/llama"
    container = _container(_isvc(model={"uri": "pvc://weights/llama-3/8b"}))
    assert container["args"][0] == f"{engine_pod.PVC_MOUNT_ROOT}/weights/llama-3/8b"
    assert {"name": "model-pvc", "mountPath": f"{engine_pod.PVC_MOUNT_ROOT}/weights", "readOnly": True} in container[
        "volumeMounts"
    ]


def test_the_pod_keeps_the_restricted_level_with_writable_caches() -> None:
    isvc = _isvc(
        model={
            "uri": "hf://org/model",
            "hubEndpoint": "https://hub.example.com",
            "hubTokenSecretRef": {"name": "hf", "key": "token"},
        },
        runtime={
            "engine": "vllm",
            "apiKeySecretRef": {"name": "api", "key": "key"},
            "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
        },
    )
    objs = render.render_children(isvc=isvc, runtime_image=RUNTIME_IMAGE, router_service_account="")
    pod_spec = _deployment(objs, "engine")["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["runAsUser"] == 65532
    env = {e["name"]: e for e in container["env"]}
    assert env["HOME"]["value"] == "/tmp"
    assert env["HF_HUB_CACHE"]["value"] == engine_pod.MODEL_CACHE_DIR
    assert env["HF_ENDPOINT"]["value"] == "https://hub.example.com"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "key"}
    assert env["VLLM_CPU_KVCACHE_SPACE"]["value"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # a GPU pool: vLLM's own binding
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", engine_pod.MODEL_CACHE_DIR, engine_vllm.VLLM_CACHE_DIR, "/dev/shm"} <= mounts
    written = {env[name]["value"] for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "XDG_CACHE_HOME")}
    assert all(any(path == m or path.startswith(m + "/") for m in mounts) for path in written), written
    # vLLM's /health answers only once the engine is up: alive and ready are the same path.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert not any(p["name"] == contract.KV_TRANSFER_PORT_NAME for p in container["ports"])


def test_the_router_keeps_the_bundled_image_and_learns_the_engine() -> None:
    isvc = _isvc(runtime={"engine": "vllm", "image": "registry.example/vllm:custom"})
    objs = render.render_children(isvc=isvc, runtime_image=RUNTIME_IMAGE, router_service_account="")
    router = _deployment(objs, "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == RUNTIME_IMAGE
    assert router["args"][:2] == ["splitserve", "router"]
    assert router["args"][router["args"].index("--engine") + 1] == "vllm"
    engine = _deployment(objs, "engine")["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"] == "registry.example/vllm:custom"


def test_the_operator_flag_picks_the_default_vllm_image() -> None:
    assert _container(_isvc(), vllm_image="localhost:5000/splitserve-vllm:0.32.0")["image"] == (
        "localhost:5000/splitserve-vllm:0.32.0"
    )


def test_the_bundled_runtime_pods_are_unchanged_by_the_engine_field() -> None:
    """An explicit ``engine: splitserve`` renders exactly what leaving it out does."""
    implicit = render.render_children(isvc=_isvc(runtime={}), runtime_image=RUNTIME_IMAGE, router_service_account="")
    explicit = render.render_children(
        isvc=_isvc(runtime={"engine": "splitserve"}), runtime_image=RUNTIME_IMAGE, router_service_account=""
    )
    assert implicit == explicit
    container = _deployment(implicit, "engine")["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container and container["args"][:2] == ["splitserve", "serve"]


def test_cpu_pools_leave_thread_placement_to_the_kernel() -> None:
    """vLLM's CPU build pins its threads as if it owned the node; pods sharing one would all
    pin to the same core. A user's runtime.env still wins."""
    cpu = _isvc(aggregated={"resources": {"gpus": 0}}, kvCache={"blockSize": 32})
    env = {e["name"]: e.get("value") for e in _container(cpu)["env"]}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "OMP_NUM_THREADS" not in env
    for request, threads in (("500m", "1"), ("1500m", "1"), ("4", "4")):
        sized = _isvc(aggregated={"resources": {"gpus": 0, "cpu": request}}, kvCache={"blockSize": 32})
        assert {e["name"]: e.get("value") for e in _container(sized)["env"]}["OMP_NUM_THREADS"] == threads
    pinned = _isvc(
        aggregated={"resources": {"gpus": 0}},
        kvCache={"blockSize": 32},
        runtime={"engine": "vllm", "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}]},
    )
    assert {e["name"]: e.get("value") for e in _container(pinned)["env"]}["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_a_terminating_vllm_pod_waits_out_of_its_endpoints_before_sigterm() -> None:
    """vLLM fails requests that arrive after SIGTERM with 500 while /health still says 200: the
    pod waits (preStop) for the router to drop it first, then drains; the grace covers both."""
    objs = render.render_children(isvc=_isvc(), runtime_image=RUNTIME_IMAGE, router_service_account="")
    pod_spec = _deployment(objs, "engine")["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(engine_vllm.PRE_STOP_SECONDS)]}}}
    drain = int(_options(container["args"])["--shutdown-timeout"])
    assert pod_spec["terminationGracePeriodSeconds"] >= engine_vllm.PRE_STOP_SECONDS + drain + 5
    bundled = render.render_children(
        isvc=_isvc(runtime={"engine": "splitserve"}), runtime_image=RUNTIME_IMAGE, router_service_account=""
    )
    # the bundled runtime turns not-ready on SIGTERM itself (the router's poll sees 503)
    assert "lifecycle" not in _deployment(bundled, "engine")["spec"]["template"]["spec"]["containers"][0]


# --------------------------------------------------------------------------- Disaggregated
def _disaggregated(gpus: int = 1) -> InferenceService:
    pool = {"resources": {"gpus": gpus, **({"cpu": "1"} if gpus == 0 else {})}}
    return _isvc(
        mode="Disaggregated",
        aggregated=None,
        prefill=pool,
        decode=pool,
        **({"kvCache": {"blockSize": 32}} if gpus == 0 else {}),
    )


@pytest.mark.parametrize("suffix", ["prefill", "decode"])
def test_prefill_and_decode_pools_hand_off_with_the_nixl_connector(suffix: str) -> None:
    container = _container(_disaggregated(), suffix)
    config = json.loads(_options(container["args"])["--kv-transfer-config"])
    # every pod both sends and receives; a decode pod that cannot load the KV computes it
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == f"$({contract.ENV_POD_IP})"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(engines.VLLM_KV_SIDE_CHANNEL_PORT)
    first, last = engines.VLLM_KV_DATA_PORTS
    assert env["UCX_TCP_PORT_RANGE"] == f"{first}-{last}"
    assert "UCX_TLS" not in env  # a GPU pool: UCX picks its fastest transport
    names = [e["name"] for e in container["env"]]
    assert names.index(contract.ENV_POD_IP) < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")  # $(...) expands
    assert container["ports"][1:] == [
        {"name": contract.KV_TRANSFER_PORT_NAME, "containerPort": engines.VLLM_KV_SIDE_CHANNEL_PORT, "protocol": "TCP"}
    ]


def test_cpu_pools_keep_the_kv_in_host_memory_and_use_tcp() -> None:
    container = _container(_disaggregated(gpus=0), "decode")
    config = json.loads(_options(container["args"])["--kv-transfer-config"])
    assert config["kv_buffer_device"] == "cpu"
    assert {e["name"]: e.get("value") for e in container["env"]}["UCX_TLS"] == "tcp"


def test_aggregated_vllm_pools_have_no_kv_connector() -> None:
    container = _container(_isvc())
    assert "--kv-transfer-config" not in container["args"]
    assert not {"VLLM_NIXL_SIDE_CHANNEL_HOST", "UCX_TCP_PORT_RANGE"} & {e["name"] for e in container["env"]}


def test_network_policies_open_the_nixl_ports_to_the_other_pool_only() -> None:
    objs = render.render_children(isvc=_disaggregated(), runtime_image=RUNTIME_IMAGE, router_service_account="")
    first, last = engines.VLLM_KV_DATA_PORTS
    nixl = [
        {"protocol": "TCP", "port": engines.VLLM_KV_SIDE_CHANNEL_PORT},
        {"protocol": "TCP", "port": first, "endPort": last},
    ]
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"chat-{role}"]
        (peer_rule,) = [
            r
            for r in policy["spec"]["ingress"]
            if any(
                f.get("podSelector", {}).get("matchLabels", {}).get(contract.LABEL_COMPONENT) == other
                for f in r.get("from", [])
            )
        ]
        assert peer_rule["ports"] == [{"protocol": "TCP", "port": contract.HTTP_PORT}, *nixl]
        # nobody else reaches the NIXL ports
        others = [r for r in policy["spec"]["ingress"] if r is not peer_rule]
        assert all(p.get("port") == contract.HTTP_PORT for r in others for p in r["ports"]), others
