"""render_children: names, labels, ports, probes, argv round-trip, config hash, modes."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_operator import naming
from splitserve_operator.api import InferenceService, InvalidSpecError
from splitserve_operator.engines import pod as engine_pod
from splitserve_operator.render import render_children, router_args

IMAGE = "registry.example/splitserve:1.2.3"


def _isvc(spec: dict[str, Any] | None = None, *, name: str = "llama", namespace: str = "team-a") -> InferenceService:
    base: dict[str, Any] = {
        "model": {"uri": "hf://meta/llama-3", "dtype": "bfloat16"},
        "mode": "Disaggregated",
        "prefill": {"replicas": {"min": 2, "max": 4}, "resources": {"gpus": 1, "cpu": "4", "memory": "32Gi"}},
        "decode": {
            "replicas": {"min": 3, "max": 8},
            "resources": {"gpus": 2},
            "nodeSelector": {"gpu": "h200"},
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "inference",
        },
        "runtime": {"extraArgs": ["--max-queue-len", "64"], "env": [{"name": "FOO", "value": "bar"}]},
    }
    if spec:
        base.update(spec)
    return InferenceService.parse(
        {
            "apiVersion": "splitserve.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 3},
            "spec": base,
        }
    )


def _render(isvc: InferenceService, **kw: Any) -> list[dict[str, Any]]:
    return render_children(isvc=isvc, runtime_image=IMAGE, router_service_account="splitserve-router", **kw)


def _by(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} matches"
    return matches[0]


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def _parse_serve(command: list[str]) -> contract.ServeArgs:
    assert command[:2] == ["splitserve", "serve"]
    parser = argparse.ArgumentParser()
    contract.add_serve_arguments(parser)
    return contract.serve_args_from_namespace(parser.parse_args(command[2:]))


def test_disaggregated_children_names_and_kinds() -> None:
    objs = _render(_isvc())
    got = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    expected = sorted(
        [("ConfigMap", "llama-config"), ("NetworkPolicy", naming.network_policy_name("llama"))]
        + [
            (k, f"llama-{c}")
            for c in ("prefill", "decode", "router")
            for k in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")
        ]
    )
    assert got == expected
    assert all(o["metadata"]["namespace"] == "team-a" for o in objs)
    assert all("ownerReferences" not in o["metadata"] for o in objs)


def test_aggregated_mode_has_engine_and_router_only() -> None:
    isvc = _isvc(
        {
            "mode": "Aggregated",
            "prefill": None,
            "decode": None,
            "aggregated": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 0}},
        }
    )
    objs = _render(isvc)
    deps = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    assert deps == {"llama-engine", "llama-router"}
    engine = _by(objs, "Deployment", "llama-engine")
    args = _parse_serve(_container(engine)["args"])
    assert args.role == "aggregated"
    assert args.device == "cpu"
    ports = {p["name"]: p["containerPort"] for p in _container(engine)["ports"]}
    assert ports == {"http": 8000}
    assert "nvidia.com/gpu" not in str(_container(engine)["resources"])
    assert engine["metadata"]["labels"][contract.LABEL_ROLE] == "aggregated"


def test_labels_on_deployment_and_pod_template() -> None:
    objs = _render(_isvc())
    for role in ("prefill", "decode", "router"):
        dep = _by(objs, "Deployment", f"llama-{role}")
        for labels in (dep["metadata"]["labels"], dep["spec"]["template"]["metadata"]["labels"]):
            assert labels[contract.LABEL_NAME] == "splitserve"
            assert labels[contract.LABEL_INSTANCE] == "llama"
            assert labels[contract.LABEL_COMPONENT] == role
            assert labels[contract.LABEL_MANAGED_BY] == contract.MANAGED_BY_VALUE
            assert labels[contract.LABEL_ROLE] == role
            assert labels[contract.LABEL_SCRAPE] == "true"
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert contract.LABEL_COMPAT_HASH not in selector  # selectors are immutable
    prefill = _by(objs, "Deployment", "llama-prefill")
    decode = _by(objs, "Deployment", "llama-decode")
    assert (
        prefill["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
        == decode["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
    )


def test_serve_argv_round_trips_through_the_runtime_parser() -> None:
    objs = _render(
        _isvc(
            {
                "kvCache": {"blockSize": 32, "memoryFraction": 0.8, "prefixCaching": False},
                "engine": {"maxNumSeqs": 64, "maxBatchedTokens": 4096, "chunkedPrefill": False},
                "runtime": {},
            }
        )
    )
    decode = _parse_serve(_container(_by(objs, "Deployment", "llama-decode"))["args"])
    assert decode.role == "decode"
    assert decode.model == "hf://meta/llama-3"
    assert decode.served_model_name == "llama"
    assert decode.host == "$(POD_IP)"
    assert decode.dtype == "bfloat16"
    assert decode.tensor_parallel_size == 1
    assert decode.block_size == 32
    assert decode.kv_memory_fraction == 0.8
    assert decode.prefix_caching is False
    assert decode.chunked_prefill is False
    assert decode.max_num_seqs == 64
    assert decode.max_num_batched_tokens == 4096
    assert decode.device == "cuda"
    assert decode.kv_cache_dtype == "auto"


def test_compat_hash_is_passed_to_pods_and_matches_their_label() -> None:
    objs = _render(_isvc())
    hashes = set()
    for role in ("prefill", "decode"):
        dep = _by(objs, "Deployment", f"llama-{role}")
        args = _parse_serve(_container(dep)["args"])
        label = dep["spec"]["template"]["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
        assert args.compat_hash == label != ""
        hashes.add(args.compat_hash)
    assert len(hashes) == 1  # prefill and decode pods pair with each other
    other = _render(_isvc({"model": {"uri": "hf://meta/llama-3", "dtype": "float16"}}))
    assert _parse_serve(_container(_by(other, "Deployment", "llama-decode"))["args"]).compat_hash not in hashes


def test_extra_args_are_appended_and_parse() -> None:
    command = _container(_by(_render(_isvc()), "Deployment", "llama-prefill"))["args"]
    assert command[-2:] == ["--max-queue-len", "64"]
    assert _parse_serve(command).max_queue_len == 64


def test_router_argv() -> None:
    router = _by(_render(_isvc()), "Deployment", "llama-router")
    command = _container(router)["args"]
    assert command[:2] == ["splitserve", "router"]
    parser = argparse.ArgumentParser()
    contract.add_router_arguments(parser)
    args = contract.router_args_from_namespace(parser.parse_args(command[2:]))
    assert args.discovery == "kubernetes"
    assert args.namespace == "team-a"
    assert args.inference_service == "llama"
    assert args.policy == "PrefixAffinity"
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "splitserve-router"


def test_ports_probes_env_and_security() -> None:
    objs = _render(_isvc())
    prefill = _by(objs, "Deployment", "llama-prefill")
    c = _container(prefill)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "kv": 8100}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load
    env = {e["name"]: e for e in c["env"]}
    assert env[contract.ENV_POD_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[contract.ENV_POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[contract.ENV_POD_NAMESPACE]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["FOO"]["value"] == "bar"
    assert len(env) == len(c["env"])  # no duplicate names (SSA keys env by name)
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    pod = prefill["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    # the root filesystem is read-only: every path the image writes to is a volume
    assert {"/tmp", "/dev/shm", engine_pod.MODEL_CACHE_DIR, engine_pod.TRITON_CACHE_DIR} <= set(mounts)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[engine_pod.TRITON_CACHE_DIR]]["emptyDir"] == {}
    shm = volumes["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert pod["terminationGracePeriodSeconds"] > contract.ServeArgs().drain_timeout_seconds


def test_hub_token_and_endpoint_reach_every_container() -> None:
    isvc = _isvc(
        {
            "model": {
                "uri": "hf://meta/llama-3",
                "hubEndpoint": "https://hf-mirror.corp.example/hub",
                "hubTokenSecretRef": {"name": "hf", "key": "token"},
            }
        }
    )
    children = _render(isvc)
    for deployment in (c for c in children if c["kind"] == "Deployment"):
        env = {e["name"]: e for e in _container(deployment)["env"]}
        name = deployment["metadata"]["name"]
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}, name
        assert "value" not in env["HF_TOKEN"]
        assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.corp.example/hub", name
        assert env["SPLITSERVE_HUB_TOKEN_SOURCE"]["value"] == "Secret hf, key token"
    default_key = _isvc({"model": {"uri": "hf://meta/llama-3", "hubTokenSecretRef": {"name": "hf"}}})
    env = {e["name"]: e for e in _container(_by(_render(default_key), "Deployment", "llama-prefill"))["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert "HF_ENDPOINT" not in env  # the runtime's default: huggingface.co


def test_the_router_overflow_limit_reaches_its_argv_only_when_set() -> None:
    def argv(spec: dict[str, Any] | None) -> list[str]:
        return list(_container(_by(_render(_isvc(spec)), "Deployment", "llama-router"))["args"])

    assert "--prefill-overflow-tokens" not in argv(None)  # off: an upgrade restarts no router
    command = argv({"router": {"prefillOverflowTokens": 8000}})
    parser = argparse.ArgumentParser()
    contract.add_router_arguments(parser)
    assert contract.router_args_from_namespace(parser.parse_args(command[2:])).prefill_overflow_tokens == 8000


def test_router_reads_the_pinned_revision_from_its_model_uri() -> None:
    pinned = _isvc({"model": {"uri": "hf://meta/llama-3", "revision": "v1.2"}})
    assert router_args(isvc=pinned).model == "hf://meta/llama-3@v1.2"
    assert router_args(isvc=_isvc()).model == "hf://meta/llama-3"


def test_no_hub_token_without_a_secret_ref() -> None:
    env = {
        e["name"]
        for e in _container(
            _by(_render(_isvc({"model": {"uri": "hf://meta/llama-3"}})), "Deployment", "llama-prefill")
        )["env"]
    }
    assert not env & {"HF_TOKEN", "HF_ENDPOINT", "SPLITSERVE_HUB_TOKEN_SOURCE"}


def test_api_key_is_a_secret_reference_in_every_container() -> None:
    ref = {"name": "llama-api", "key": "api-key"}
    isvc = _isvc({"model": {"uri": "hf://meta/llama-3"}, "runtime": {"apiKeySecretRef": ref}})
    objs = _render(isvc)
    for role in ("prefill", "decode", "router"):
        env = {e["name"]: e for e in _container(_by(objs, "Deployment", f"llama-{role}"))["env"]}
        assert env[contract.ENV_API_KEY] == {"name": contract.ENV_API_KEY, "valueFrom": {"secretKeyRef": ref}}, role
    plain = _render(_isvc())
    for role in ("prefill", "decode", "router"):
        names = {e["name"] for e in _container(_by(plain, "Deployment", f"llama-{role}"))["env"]}
        assert contract.ENV_API_KEY not in names, role


def test_api_key_secret_ref_needs_name_and_key() -> None:
    with pytest.raises(InvalidSpecError):
        _isvc({"model": {"uri": "hf://meta/llama-3"}, "runtime": {"apiKeySecretRef": {"name": "llama-api"}}})


def test_gpu_resources_and_scheduling_fields() -> None:
    objs = _render(_isvc())
    decode = _by(objs, "Deployment", "llama-decode")
    res = _container(decode)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == 2 and res["limits"]["nvidia.com/gpu"] == 2
    pod = decode["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"][0]["key"] == "kwok.x-k8s.io/node"
    assert pod["priorityClassName"] == "inference"
    prefill_res = _container(_by(objs, "Deployment", "llama-prefill"))["resources"]
    assert prefill_res["requests"]["cpu"] == "4" and prefill_res["limits"]["memory"] == "32Gi"


def test_replicas_only_when_asked() -> None:
    isvc = _isvc()
    for dep in (o for o in _render(isvc) if o["kind"] == "Deployment"):
        assert "replicas" not in dep["spec"]
    with_replicas = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in _render(isvc, include_replicas=True)
        if o["kind"] == "Deployment"
    }
    assert with_replicas == {"llama-prefill": 2, "llama-decode": 3, "llama-router": 1}


def _hashes(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][contract.ANNOTATION_CONFIG_HASH]
        for o in objs
        if o["kind"] == "Deployment"
    }


def test_config_hash_changes_with_config_not_with_replicas() -> None:
    base = _hashes(_render(_isvc()))
    assert _hashes(_render(_isvc())) == base  # deterministic
    more_replicas = _isvc(
        {"prefill": {"replicas": {"min": 3, "max": 9}, "resources": {"gpus": 1, "cpu": "4", "memory": "32Gi"}}}
    )
    assert _hashes(_render(more_replicas)) == base
    new_block = _hashes(_render(_isvc({"kvCache": {"blockSize": 32}})))
    assert all(new_block[k] != base[k] for k in ("llama-prefill", "llama-decode"))
    new_image = _hashes(_render(_isvc({"runtime": {"image": "other:2"}})))
    assert new_image["llama-prefill"] != base["llama-prefill"]


def test_fp8_kv_cache_is_rendered_and_changes_the_compat_hash() -> None:
    auto, fp8 = _render(_isvc()), _render(_isvc({"kvCache": {"dtype": "fp8"}}))
    for role in ("prefill", "decode"):
        name = f"llama-{role}"
        args = _parse_serve(_container(_by(fp8, "Deployment", name))["args"])
        assert args.kv_cache_dtype == "fp8"
        assert "--kv-cache-dtype" not in _container(_by(auto, "Deployment", name))["args"]
        label = _by(fp8, "Deployment", name)["metadata"]["labels"][contract.LABEL_COMPAT_HASH]
        assert args.compat_hash == label
        assert label != _by(auto, "Deployment", name)["metadata"]["labels"][contract.LABEL_COMPAT_HASH]


def test_network_policies() -> None:
    objs = _render(_isvc())
    deny = _by(objs, "NetworkPolicy", naming.network_policy_name("llama"))
    assert "ingress" not in deny["spec"] and deny["spec"]["policyTypes"] == ["Ingress"]
    router = _by(objs, "NetworkPolicy", "llama-router")
    assert router["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    prefill = _by(objs, "NetworkPolicy", "llama-prefill")
    kv_rules = [r for r in prefill["spec"]["ingress"] if {"protocol": "TCP", "port": 8100} in r["ports"]]
    assert kv_rules and kv_rules[0]["from"][0]["podSelector"]["matchLabels"][contract.LABEL_COMPONENT] == "decode"
    http_rule = prefill["spec"]["ingress"][0]
    sources = [f.get("podSelector", {}).get("matchLabels", {}).get(contract.LABEL_COMPONENT) for f in http_rule["from"]]
    assert "router" in sources
    assert any("namespaceSelector" in f for f in http_rule["from"])


def test_config_map_holds_engine_config() -> None:
    import json

    cm = _by(_render(_isvc()), "ConfigMap", "llama-config")
    engine = json.loads(cm["data"]["engine.json"])
    assert engine["prefill"]["serveArgs"]["role"] == "prefill"
    assert engine["decode"]["serveArgs"]["tensor_parallel_size"] == 1
    assert engine["router"]["inference_service"] == "llama"
    assert contract.ANNOTATION_CONFIG_HASH in cm["metadata"]["annotations"]


def test_pvc_model_is_mounted_read_only() -> None:
    objs = _render(_isvc({"model": {"uri": "pvc://models/llama/8b"}}))
    dep = _by(objs, "Deployment", "llama-prefill")
    args = _parse_serve(_container(dep)["args"])
    assert args.model == "file:///mnt/models/models/llama/8b"
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v)
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


@pytest.mark.parametrize("value", ['"; rm -rf /', "a\nkind: Secret", "{{ x }}"])
def test_user_strings_cannot_change_structure(value: str) -> None:
    isvc = _isvc({"runtime": {"env": [{"name": "X", "value": value}], "extraArgs": [value]}})
    objs = _render(isvc)
    dep = _by(objs, "Deployment", "llama-prefill")
    assert _container(dep)["args"][-1] == value
    assert {e["name"]: e.get("value") for e in _container(dep)["env"]}["X"] == value
    assert copy.deepcopy(objs) == objs


def test_containers_report_why_they_exited() -> None:
    """The runtime writes its load error to the termination message file, and the log tail is
    the fallback: the reconciler turns either into a ModelUnavailable/PodStartFailed condition."""
    objs = _render(_isvc())
    for role in ("prefill", "decode", "router"):
        container = _container(_by(objs, "Deployment", f"llama-{role}"))
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", role
        assert container["terminationMessagePath"] == contract.TERMINATION_MESSAGE_PATH, role


def test_containers_keep_the_image_entrypoint() -> None:
    """`args` only: the image's ENTRYPOINT (tini) stays PID 1 and forwards SIGTERM."""
    for mode_isvc in (
        _isvc(),
        _isvc({"mode": "Aggregated", "aggregated": {"resources": {"gpus": 1}}, "prefill": None, "decode": None}),
    ):
        for deployment in (c for c in _render(mode_isvc) if c["kind"] == "Deployment"):
            container = _container(deployment)
            assert "command" not in container, deployment["metadata"]["name"]
            assert container["args"][0] == "splitserve"
            assert container["args"][1] in ("serve", "router")
