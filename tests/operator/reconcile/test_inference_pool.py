"""spec.router.mode InferencePool: what the operator renders to put an InferenceService behind a
Gateway (an InferencePool selecting the pods that answer clients, the endpoint picker with
exactly the permissions it reads with, no builtin router), what admission refuses, the
operator's chart RBAC that lets it grant those permissions without escalate or bind, and the
reconciler's Stalled/InferencePoolCRDMissing on a cluster without the CRD (against the in-memory
API server of kube_testing)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_rbac import helm_binary, holds, operator_rules
from kube_testing import FakeKube, api_error, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, ModelServerMetric, Reason, Role
from splitserve_operator import inference_pool, naming, reconcile
from splitserve_operator.api import InferenceService, InvalidSpecError, rules
from splitserve_operator.render import components, render_children

REPO = Path(__file__).resolve().parents[3]
NAME, NAMESPACE = "chat", "team-a"
PICKER = f"{NAME}-epp"
CRD_MISSING = api_error(404, "NotFound", "the server could not find the requested resource")


def _isvc(mode: str = "Aggregated", router: dict[str, Any] | None = None) -> InferenceService:
    pool = {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 1}}
    pools = {"aggregated": pool} if mode == "Aggregated" else {"prefill": pool, "decode": pool}
    return InferenceService.parse(
        {
            "apiVersion": "splitserve.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "u", "generation": 1},
            "spec": {
                "model": {"uri": "hf://org/model"},
                "mode": mode,
                **pools,
                "router": {"mode": "InferencePool"} if router is None else router,
            },
        }
    )


def _render(isvc: InferenceService) -> list[dict[str, Any]]:
    return render_children(isvc=isvc, runtime_image="img:1", router_service_account="")


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)}"
    return found[0]


def _pod_labels(objs: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    return dict(_one(objs, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# ---------------------------------------------------------------------------- rendering
@pytest.mark.parametrize(
    ("mode", "served", "others"),
    [
        ("Aggregated", "engine", []),
        ("Disaggregated", "decode", ["prefill"]),
    ],
)
def test_inference_pool_selects_the_pods_that_answer_clients(mode: str, served: str, others: list[str]) -> None:
    objs = _render(_isvc(mode))
    pool = _one(objs, "InferencePool", NAME)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    selector = spec["selector"]["matchLabels"]
    assert _selects(selector, _pod_labels(objs, f"{NAME}-{served}"))
    for other in [*others, "epp"]:
        assert not _selects(selector, _pod_labels(objs, f"{NAME}-{other}")), other
    assert spec["targetPorts"] == [{"number": contract.HTTP_PORT}]
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": PICKER,
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # the picker's Service answers on that port, over HTTP/2, at the picker's pods
    service = _one(objs, "Service", PICKER)
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == 9002)
    assert grpc["appProtocol"] == "http2" and grpc["targetPort"] == "grpc"
    assert _selects(service["spec"]["selector"], _pod_labels(objs, PICKER))
    assert pool["metadata"]["labels"][contract.LABEL_INSTANCE] == NAME


def test_failure_mode_and_picker_image_come_from_the_spec() -> None:
    objs = _render(
        _isvc(
            router={
                "mode": "InferencePool",
                "inferencePool": {"failureMode": "FailOpen", "picker": {"image": "registry.example/llm-d/epp:v0.3"}},
            }
        )
    )
    assert _one(objs, "InferencePool", NAME)["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert (
        _one(objs, "Deployment", PICKER)["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example/llm-d/epp:v0.3"
    )
    default = _one(_render(_isvc()), "Deployment", PICKER)["spec"]["template"]["spec"]["containers"][0]
    assert default["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.2.0"


@pytest.mark.parametrize("mode", ["Aggregated", "Disaggregated"])
def test_no_builtin_router_in_inference_pool_mode(mode: str) -> None:
    objs = _render(_isvc(mode))
    assert not [o for o in objs if o["metadata"]["name"] == f"{NAME}-router"]
    assert Role.ROUTER not in {c.role for c in components(_isvc(mode).spec)}
    # and the builtin mode is as before: a router, no InferencePool, no picker
    builtin = _render(_isvc(mode, router={}))
    assert _one(builtin, "Deployment", f"{NAME}-router")
    assert not [
        o
        for o in builtin
        if o["kind"] in ("InferencePool", "Role", "RoleBinding", "ServiceAccount") or o["metadata"]["name"] == PICKER
    ]


def _flags(args: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        name, sep, value = args[i].partition("=")
        if sep:
            out[name] = value
            i += 1
        else:
            out[name] = args[i + 1]
            i += 2
    return out


def test_picker_deployment_points_the_epp_at_its_pool_and_our_metrics() -> None:
    objs = _render(_isvc("Disaggregated"))
    deployment = _one(objs, "Deployment", PICKER)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    flags = _flags(container["args"])
    assert (flags["--pool-name"], flags["--pool-namespace"]) == (NAME, NAMESPACE)
    assert (flags["--grpc-port"], flags["--grpc-health-port"], flags["--metrics-port"]) == ("9002", "9003", "9090")
    # the model-server metrics the runtime exports, not the EPP's older vLLM default
    assert flags["--total-queued-requests-metric"] == ModelServerMetric.NUM_REQUESTS_WAITING
    assert flags["--kv-cache-usage-percentage-metric"] == ModelServerMetric.KV_CACHE_USAGE_PERC
    assert flags["--cache-info-metric"] == ModelServerMetric.CACHE_CONFIG_INFO
    assert flags["--lora-info-metric"] == "" and flags["--metrics-endpoint-auth"] == "false"
    config = yaml.safe_load(flags["--config-text"])
    assert config["kind"] == "EndpointPickerConfig"
    assert {p["type"] for p in config["plugins"]} == {
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
    }
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": 9003, "service": "inference-extension"}
    # as locked down as the runtime pods, under its own ServiceAccount
    engine = _one(objs, "Deployment", f"{NAME}-decode")["spec"]["template"]["spec"]
    assert container["securityContext"] == engine["containers"][0]["securityContext"]
    assert pod["securityContext"] == engine["securityContext"]
    assert pod["serviceAccountName"] == PICKER and pod["automountServiceAccountToken"] is True
    labels = _pod_labels(objs, PICKER)
    assert labels[contract.LABEL_COMPONENT] == "endpoint-picker" and contract.LABEL_ROLE not in labels
    assert contract.ANNOTATION_CONFIG_HASH in deployment["spec"]["template"]["metadata"]["annotations"]


def test_picker_rbac_is_exactly_what_the_epp_reads() -> None:
    objs = _render(_isvc())
    account = _one(objs, "ServiceAccount", PICKER)
    assert account["automountServiceAccountToken"] is False
    role = _one(objs, "Role", PICKER)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "resourceNames": [NAME],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    binding = _one(objs, "RoleBinding", PICKER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PICKER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PICKER, "namespace": NAMESPACE}]


def test_network_policies_open_the_served_pool_and_the_picker_to_the_gateway() -> None:
    objs = _render(_isvc("Disaggregated"))
    port = {"protocol": "TCP", "port": contract.HTTP_PORT}
    decode = _one(objs, "NetworkPolicy", f"{NAME}-decode")["spec"]["ingress"]
    assert {"ports": [port]} in decode  # the Gateway's proxies, wherever they run, and the picker
    prefill = _one(objs, "NetworkPolicy", f"{NAME}-prefill")["spec"]["ingress"]
    assert all("from" in rule for rule in prefill)  # only decode pods and monitoring
    picker = _one(objs, "NetworkPolicy", PICKER)
    assert _selects(picker["spec"]["podSelector"]["matchLabels"], _pod_labels(objs, PICKER))
    assert {"ports": [{"protocol": "TCP", "port": 9002}]} in picker["spec"]["ingress"]
    metrics = next(r for r in picker["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 9090}])
    assert "namespaceSelector" in metrics["from"][0]


# ---------------------------------------------------------------------------- admission
def _spec_with(router: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "mode": "Aggregated",
            "aggregated": {"resources": {"gpus": 0}},
            "router": router,
        },
    }


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"inferencePool": {"failureMode": "FailOpen"}}, rules.INFERENCE_POOL_SETTINGS_RULE_MESSAGE),
        ({"mode": "Builtin", "inferencePool": {}}, rules.INFERENCE_POOL_SETTINGS_RULE_MESSAGE),
        ({"mode": "Gateway"}, "spec.router.mode"),
        ({"mode": "InferencePool", "inferencePool": {"failureMode": "Open"}}, "failureMode"),
        ({"mode": "InferencePool", "inferencePool": {"picker": {"image": "has space"}}}, "image"),
        ({"mode": "InferencePool", "inferencePool": {"picker": {"replicas": 2}}}, "replicas"),
    ],
)
def test_admission_refuses_bad_router_settings(router: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError) as refused:
        InferenceService.parse(_spec_with(router))
    assert message in str(refused.value)


def test_crd_carries_the_router_rules_with_their_messages() -> None:
    import crdgen

    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    by_message = {r["message"]: r["rule"] for r in schema["x-kubernetes-validations"]}
    assert "self.router.mode == 'InferencePool'" in by_message[rules.INFERENCE_POOL_SETTINGS_RULE_MESSAGE]
    # a transition rule (the API server evaluates it on updates only): the mode is fixed
    assert "oldSelf.router.mode" in by_message[rules.ROUTER_MODE_IMMUTABLE_RULE_MESSAGE]
    router = schema["properties"]["router"]["properties"]
    assert router["mode"]["enum"] == ["Builtin", "InferencePool"] and router["mode"]["default"] == "Builtin"
    assert router["inferencePool"]["properties"]["failureMode"]["default"] == "FailClose"


def test_example_parses_and_renders_an_inference_pool() -> None:
    obj = yaml.safe_load((REPO / "examples" / "gateway-inferencepool.yaml").read_text())
    isvc = InferenceService.parse({**obj, "metadata": {**obj["metadata"], "namespace": "default"}})
    assert inference_pool.enabled(isvc.spec)
    assert _one(_render(isvc), "InferencePool", isvc.metadata.name)


# ---------------------------------------------------------------------------- the chart
@pytest.mark.skipif(helm_binary() is None, reason="helm binary not found (run the e2e build first)")
@pytest.mark.parametrize(("sets", "kind"), [((), "ClusterRole"), (("rbac.scope=namespace",), "Role")])
def test_operator_holds_what_it_grants_and_manages_the_new_children(sets: tuple[str, ...], kind: str) -> None:
    held = operator_rules(sets=(*sets, "inferencePool.enabled=true"), kind=kind)  # off by default
    # RBAC lets a subject create a Role only with permissions it holds itself (no escalate/bind).
    for rule in inference_pool.picker_rules(NAME):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert holds(held, group, resource, verb), (group, resource, verb)
    for group, resource in [
        ("inference.networking.k8s.io", "inferencepools"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
    ]:
        for verb in ("create", "get", "patch"):
            assert holds(held, group, resource, verb), (resource, verb)
    assert not any({"escalate", "bind", "impersonate", "*"} & set(r["verbs"]) for r in held)


# ---------------------------------------------------------------------------- reconcile
def _pool_obj(mode: str = "Aggregated") -> dict[str, Any]:
    obj: dict[str, Any] = isvc_obj(mode=mode)
    obj["spec"]["router"] = {"mode": "InferencePool"}
    return obj


def test_missing_crd_is_stalled_with_a_reason_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    events = record_events(monkeypatch)
    fake = FakeKube()
    fake.ready_replicas = 1
    fake.errors["InferencePool/tiny"] = CRD_MISSING
    for _ in range(2):
        with pytest.raises(reconcile.RetryableError, match=inference_pool.CRD_NAME):
            run(fake, _pool_obj())
    conditions = {c["type"]: c for c in fake.objects[(contract.KIND, "tiny")]["status"]["conditions"]}
    stalled = conditions[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.INFERENCE_POOL_CRD_MISSING)
    assert inference_pool.CRD_NAME in stalled["message"] and inference_pool.CRDS_MANIFEST_URL in stalled["message"]
    assert conditions[ConditionType.READY]["status"] == "False"
    # one Warning Event, not one per retry; the other children were applied meanwhile
    assert [e[:2] for e in events if e[1] == Reason.INFERENCE_POOL_CRD_MISSING] == [
        ("Warning", Reason.INFERENCE_POOL_CRD_MISSING)
    ]
    assert ("Deployment", "tiny-engine") in fake.objects and ("Deployment", "tiny-epp") in fake.objects
    # the CRD is installed: the next retry converges
    del fake.errors["InferencePool/tiny"]
    result, conditions = run(fake)
    assert result.ready and conditions[ConditionType.STALLED]["status"] == "False"
    assert ("InferencePool", "tiny") in fake.objects


def test_ready_waits_for_the_picker(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube()
    fake.ready_replicas = 1
    applied = fake.apply

    def apply(*, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        out: dict[str, Any] = applied(obj=obj, field_manager=field_manager, force=force)
        if out.get("kind") == "Deployment" and out["metadata"]["name"] == "tiny-epp":
            out["status"].update(readyReplicas=0, availableReplicas=0)  # every pod ready but the picker's
        return out

    monkeypatch.setattr(fake, "apply", apply)
    result, conditions = run(fake, _pool_obj("Disaggregated"))
    assert not result.ready
    assert conditions[ConditionType.READY]["status"] == "False"
    assert conditions[ConditionType.READY]["message"] == "Waiting for endpoint picker 0/1 ready"


def test_picker_stands_where_the_router_stands() -> None:
    fake = FakeKube()
    result, conditions = run(fake, _pool_obj("Disaggregated"))
    assert not result.ready  # no pod ready yet
    fake.ready_replicas = 1
    result, conditions = run(fake)
    assert result.ready and conditions[ConditionType.READY]["status"] == "True"
    status = fake.objects[(contract.KIND, "tiny")]["status"]
    # the picker's pods, counted apart: the Router column shows no router where there is none
    assert status["endpointPicker"]["summary"] == "1/1" and status.get("router") is None
    assert "endpoint" not in status  # the Gateway's address is not the operator's to know
    assert "Deployment/tiny-router" not in {w for w, _ in fake.writes}
    # the API server checks a RoleBinding against its Role: the Role is applied first
    order = [w for w, verb in fake.writes if verb == "apply"]
    assert order.index("Role/tiny-epp") < order.index("RoleBinding/tiny-epp")
    assert order.index("ServiceAccount/tiny-epp") < order.index("Deployment/tiny-epp")
    # one picker, whatever happened to it
    fake.objects[("Deployment", "tiny-epp")]["spec"]["replicas"] = 0
    run(fake)
    assert fake.objects[("Deployment", "tiny-epp")]["spec"]["replicas"] == 1


def test_a_picker_that_cannot_start_is_reported() -> None:
    fake = FakeKube()
    fake.pods = [
        {
            "metadata": {"name": "tiny-epp-7d9", "labels": {**inference_pool.picker_labels("tiny")}},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "epp",
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "registry.k8s.io/..."',
                            }
                        },
                    }
                ],
            },
        }
    ]
    result, conditions = run(fake, _pool_obj())
    assert result.outcome == Reason.IMAGE_PULL_BACK_OFF
    assert conditions[ConditionType.STALLED]["status"] == "True"
    assert "tiny-epp-7d9" in conditions[ConditionType.STALLED]["message"]


def test_rendering_is_deterministic_and_names_fit() -> None:
    isvc = _isvc("Disaggregated")
    assert _render(isvc) == _render(copy.deepcopy(isvc))
    longest = "x" * naming.MAX_NAME_LENGTH
    assert len(inference_pool.picker_name(longest)) <= 63


@pytest.mark.parametrize("mode", ["Aggregated", "Disaggregated"])
def test_only_decode_pods_behind_a_picker_honour_its_prefill_headers(mode: str) -> None:
    """``--prefill-headers`` goes to the decode pods of an InferencePool-mode service and to no
    other pod: elsewhere a client could name any address in the header."""

    def runtime_args(objs: list[dict[str, Any]]) -> dict[str, list[str]]:
        return {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["args"]
            for o in objs
            if o["kind"] == "Deployment" and o["spec"]["template"]["spec"]["containers"][0]["args"][1:2] == ["serve"]
        }

    picked = runtime_args(_render(_isvc(mode)))
    assert picked, "no runtime Deployment rendered"
    for name, args in picked.items():
        assert ("--prefill-headers" in args) is name.endswith("-decode"), (name, args)
        if "--prefill-headers" in args:  # a key-less pod would send a client's key to any address named
            assert "--handoff-key-file" in args, (name, args)
    for name, args in runtime_args(_render(_isvc(mode, router={}))).items():
        assert "--prefill-headers" not in args, (name, args)
