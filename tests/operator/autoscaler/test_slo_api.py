"""``spec.autoscaling.slo`` and ``status.<pool>.lastDecision.model``: the models accept what
the docs promise and refuse the rest with messages a user can act on, the CRD carries the
same bounds, and a real kube-apiserver with the generated CRD refuses bad SLOs at admission
(its OpenAPI bounds and the CEL rule for zero durations)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import crdgen
import pytest
from autoscaler_testing import bare_apiserver
from kubernetes.client.exceptions import ApiException

from splitserve_contract import API_GROUP, API_VERSION, KIND
from splitserve_operator import api, kube
from splitserve_operator.api.spec import SloSpec
from splitserve_operator.autoscaler.slo.inputs import StepCoefficients
from splitserve_operator.autoscaler.slo.round import slo_target
from splitserve_operator.autoscaler.slo.store import SloStore
from splitserve_operator.naming import slo_state_config_map_name

PRIOR = {"step": 0.004, "prefillToken": 2e-5, "prefillPair": 1e-9, "decodeRow": 5e-5, "decodeContext": 1e-8}
CRD_KIND = kube.Kind(
    "apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False
)
NAMESPACE_KIND = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)


def _isvc(slo: dict[str, Any] | None, *, name: str = "demo") -> dict[str, Any]:
    autoscaling: dict[str, Any] = {} if slo is None else {"slo": slo}
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"model": {"uri": "hf://org/model"}, "prefill": {}, "decode": {}, "autoscaling": autoscaling},
    }


def _errors(slo: dict[str, Any]) -> str:
    with pytest.raises(api.InvalidSpecError) as info:
        api.InferenceService.parse(_isvc(slo))
    return " | ".join(info.value.errors)


def test_absent_slo_is_todays_behaviour() -> None:
    spec = api.InferenceService.parse(_isvc(None)).spec
    assert spec.autoscaling.slo is None
    assert "slo" not in api.InferenceService.parse(_isvc(None)).dump()["spec"]["autoscaling"]


def test_an_slo_parses_with_defaults_and_converts_to_the_controllers_target() -> None:
    spec = api.InferenceService.parse(_isvc({"ttftP99": "500ms", "itlP99": "50ms"})).spec
    slo = spec.autoscaling.slo
    assert slo is not None
    assert (slo.attainment, slo.headroom, slo.prior) == (0.99, 0.8, None)
    target = slo_target(slo)
    assert (target.ttft_p99_seconds, target.itl_p99_seconds) == (0.5, 0.05)
    assert (target.attainment, target.headroom, target.prior) == (0.99, 0.8, None)


def test_the_prior_is_the_five_step_coefficients_in_seconds() -> None:
    parsed = api.InferenceService.parse(
        _isvc({"ttftP99": "1s", "itlP99": "40ms", "attainment": 0.95, "headroom": 0.7, "prior": PRIOR})
    )
    slo = parsed.spec.autoscaling.slo
    assert slo is not None
    target = slo_target(slo)
    assert target.prior == StepCoefficients(
        step=0.004, prefill_token=2e-5, prefill_pair=1e-9, decode_row=5e-5, decode_context=1e-8
    )
    assert (target.attainment, target.headroom) == (0.95, 0.7)
    # round trip: what the operator dumps parses back to the same spec
    assert parsed.dump()["spec"]["autoscaling"]["slo"]["prior"] == PRIOR
    assert api.InferenceService.parse(parsed.dump()).spec.autoscaling.slo == slo


def test_the_prior_splitserve_plan_prints_parses_back_to_its_coefficients() -> None:
    from splitserve_planner.slo_prior import prior_manifest

    true = StepCoefficients(
        step=3.2e-3, prefill_token=1.7e-5, prefill_pair=4.1e-10, decode_row=6.3e-5, decode_context=2.2e-8
    )
    slo = {"ttftP99": "500ms", "itlP99": "50ms", "prior": prior_manifest(true)}
    parsed = api.InferenceService.parse(_isvc(slo)).spec.autoscaling.slo
    assert parsed is not None
    prior = slo_target(parsed).prior
    assert prior is not None
    assert prior.as_tuple() == pytest.approx(true.as_tuple(), rel=1e-3)


@pytest.mark.parametrize(
    ("slo", "fragment"),
    [
        ({"itlP99": "50ms"}, "ttftP99"),
        ({"ttftP99": "500ms"}, "itlP99"),
        ({"ttftP99": "half a second", "itlP99": "50ms"}, "ttftP99"),
        ({"ttftP99": "0s", "itlP99": "50ms"}, api.rules.SLO_TARGETS_RULE_MESSAGE),
        ({"ttftP99": "500ms", "itlP99": "0ms"}, api.rules.SLO_TARGETS_RULE_MESSAGE),
        ({"ttftP99": "500ms", "itlP99": "50ms", "attainment": 0.5}, "greater than 0.5"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "attainment": 1}, "less than 1"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "headroom": 0}, "greater than 0"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "headroom": 1.2}, "less than or equal to 1"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "prior": {**PRIOR, "decodeRow": -1e-5}}, "decodeRow"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "prior": {k: v for k, v in PRIOR.items() if k != "step"}}, "step"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "prior": {**PRIOR, "bogus": 1}}, "bogus"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "targetTTFT": "1s"}, "targetTTFT"),
    ],
)
def test_invalid_slos_name_the_field(slo: dict[str, Any], fragment: str) -> None:
    assert fragment in _errors(slo)


def test_zero_targets_are_refused_with_the_shared_message() -> None:
    with pytest.raises(ValueError, match="above 0s"):
        SloSpec.model_validate({"ttftP99": "0ms", "itlP99": "50ms"})


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_crd_schema_carries_the_slo_bounds_and_rule() -> None:
    autoscaling = _schema()["properties"]["spec"]["properties"]["autoscaling"]
    slo = autoscaling["properties"]["slo"]
    fields = slo["properties"]
    assert slo["required"] == ["ttftP99", "itlP99"]
    assert fields["ttftP99"]["pattern"] == fields["itlP99"]["pattern"] == api.fields.DURATION_PATTERN
    assert fields["attainment"] | {"description": ""} == {
        "description": "",
        "type": "number",
        "default": 0.99,
        "minimum": 0.5,
        "exclusiveMinimum": True,
        "maximum": 1,
        "exclusiveMaximum": True,
    }
    assert (fields["headroom"]["minimum"], fields["headroom"]["exclusiveMinimum"], fields["headroom"]["maximum"]) == (
        0,
        True,
        1,
    )
    prior = fields["prior"]
    assert sorted(prior["required"]) == sorted(PRIOR)
    assert all(prior["properties"][k] == prior["properties"][k] | {"type": "number", "minimum": 0} for k in PRIOR)
    # the whole slo block is absent by default: no SLO unless asked for
    assert "slo" not in autoscaling.get("default", {})
    rules = [r["message"] for r in autoscaling["x-kubernetes-validations"]]
    assert api.rules.SLO_TARGETS_RULE_MESSAGE in rules


def test_status_last_decision_has_a_model_map() -> None:
    for pool in ("prefill", "decode", "aggregated"):
        decision = _schema()["properties"]["status"]["properties"][pool]["properties"]["lastDecision"]
        model = decision["properties"]["model"]
        assert model["type"] == "object" and model["additionalProperties"] == {"type": "number"}
    status = api.InferenceServiceStatus.model_validate(
        {
            "prefill": {
                "lastDecision": {
                    "time": "2026-01-01T00:00:00Z",
                    "result": 2,
                    "reason": "SloMet",
                    "model": {"confidence": 0.5, "ttftEstimateSeconds": 0.2},
                }
            }
        }
    )
    assert status.prefill is not None and status.prefill.last_decision is not None
    assert status.prefill.last_decision.model == {"confidence": 0.5, "ttftEstimateSeconds": 0.2}


# --------------------------------------------------------------------------- admission
@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube.Kube]:
    """A real kube-apiserver (with etcd) serving the generated CRD."""
    with bare_apiserver(tmp_path_factory.mktemp("slo-admission")) as server:
        client = kube.Kube(api_client=server.api_client)
        client.create(kind=CRD_KIND, namespace=None, obj=crdgen.crd())
        client.create(kind=NAMESPACE_KIND, namespace=None, obj={"metadata": {"name": "ns"}})
        _wait_served(client)
        yield client


def _wait_served(client: kube.Kube) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            client.list(kind=kube.INFERENCE_SERVICE, namespace="ns")
            return
        except ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _create(client: kube.Kube, slo: dict[str, Any], name: str) -> ApiException | None:
    try:
        client.create(kind=kube.INFERENCE_SERVICE, namespace="ns", obj=_isvc(copy.deepcopy(slo), name=name))
    except ApiException as exc:
        return exc
    return None


@pytest.mark.slow
def test_admission_accepts_a_full_slo_and_defaults_it(apiserver: kube.Kube) -> None:
    assert _create(apiserver, {"ttftP99": "500ms", "itlP99": "50ms", "prior": PRIOR}, "ok") is None
    stored = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace="ns", name="ok")
    assert stored is not None
    slo = stored["spec"]["autoscaling"]["slo"]
    assert (slo["attainment"], slo["headroom"], slo["prior"]) == (0.99, 0.8, PRIOR)
    assert api.InferenceService.parse(stored).spec.autoscaling.slo is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("slo", "fragment"),
    [
        ({"ttftP99": "0s", "itlP99": "50ms"}, api.rules.SLO_TARGETS_RULE_MESSAGE),
        ({"ttftP99": "500ms", "itlP99": "0ms"}, api.rules.SLO_TARGETS_RULE_MESSAGE),
        ({"ttftP99": "soon", "itlP99": "50ms"}, "spec.autoscaling.slo.ttftP99"),
        ({"itlP99": "50ms"}, "spec.autoscaling.slo.ttftP99"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "attainment": 0.5}, "spec.autoscaling.slo.attainment"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "attainment": 1}, "spec.autoscaling.slo.attainment"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "headroom": 0}, "spec.autoscaling.slo.headroom"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "prior": {**PRIOR, "step": -1}}, "spec.autoscaling.slo.prior.step"),
        ({"ttftP99": "500ms", "itlP99": "50ms", "prior": {"step": 0.001}}, "spec.autoscaling.slo.prior.prefillToken"),
    ],
)
def test_admission_refuses_bad_slos(apiserver: kube.Kube, slo: dict[str, Any], fragment: str) -> None:
    refused = _create(apiserver, slo, "bad")
    assert refused is not None and refused.status == 422, refused
    assert fragment in json.loads(str(refused.body))["message"]
    # and the operator's own parse refuses it too
    with pytest.raises(api.InvalidSpecError):
        api.InferenceService.parse(_isvc(slo))


@pytest.mark.slow
def test_the_api_server_stores_the_model_in_status_and_the_state_configmap(apiserver: kube.Kube) -> None:
    assert _create(apiserver, {"ttftP99": "500ms", "itlP99": "50ms"}, "stored") is None
    live = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace="ns", name="stored")
    assert live is not None
    model = {"confidence": 0.75, "decodeRow": 5e-5, "ttftEstimateSeconds": 0.21}
    apiserver.merge_patch(
        kind=kube.INFERENCE_SERVICE,
        namespace="ns",
        name="stored",
        subresource="status",
        patch={
            "status": {
                "decode": {
                    "lastDecision": {"time": "2026-01-01T00:00:00Z", "result": 3, "reason": "SloMet", "model": model}
                }
            }
        },
    )
    after = apiserver.get(kind=kube.INFERENCE_SERVICE, namespace="ns", name="stored")
    assert after is not None and after["status"]["decode"]["lastDecision"]["model"] == model

    store = SloStore()
    state = store.load(api=apiserver, namespace="ns", name="stored")
    state.record_replicas_write("decode", 10.0, 3)
    assert store.save(api=apiserver, namespace="ns", name="stored", uid=str(live["metadata"]["uid"]), now_seconds=10.0)
    cm = apiserver.get(kind=kube.CONFIG_MAP, namespace="ns", name=slo_state_config_map_name("stored"))
    assert cm is not None and cm["metadata"]["ownerReferences"][0]["uid"] == live["metadata"]["uid"]
    assert SloStore().load(api=apiserver, namespace="ns", name="stored").pending_writes == {"decode": [(10.0, 3)]}
