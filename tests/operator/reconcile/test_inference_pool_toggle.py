"""InferencePool mode is an install-time choice: an operator started without ``--inference-pool``
(the chart's ``inferencePool.enabled``, off by default) holds no permission to create
ServiceAccounts, Roles and RoleBindings, so it must not try to render an endpoint picker. An
InferenceService asking for that mode is reported ``Stalled``/``InferencePoolDisabled`` with a
message naming the chart value, and nothing else is written for it; the built-in router mode is
untouched. Also the operator's flags for it and for the watched namespaces (``--namespace``
takes a comma-separated list: the chart's ``rbac.scope: namespaces``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import kube_testing
import pytest
from kube_testing import FakeKube, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_operator import inference_pool, main, operator_flags

DISABLED = dataclasses.replace(kube_testing.SETTINGS, inference_pool=False)


def _pool_obj(mode: str = "Aggregated", generation: int = 1) -> dict[str, Any]:
    obj: dict[str, Any] = isvc_obj(mode=mode, generation=generation)
    obj["spec"]["router"] = {"mode": "InferencePool"}
    return obj


def _children(fake: FakeKube) -> set[tuple[str, str]]:
    return {key for key in fake.objects if key[0] != contract.KIND}


@pytest.mark.parametrize("mode", ["Aggregated", "Disaggregated"])
def test_inference_pool_mode_is_stalled_when_the_operator_was_installed_without_it(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setattr(kube_testing, "SETTINGS", DISABLED)
    events = record_events(monkeypatch)
    fake = FakeKube()
    fake.ready_replicas = 1
    for _ in range(2):
        result, conditions = run(fake, _pool_obj(mode))
        assert result.outcome == Reason.INFERENCE_POOL_DISABLED and not result.ready
    stalled = conditions[ConditionType.STALLED]
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.INFERENCE_POOL_DISABLED)
    assert f"--set {inference_pool.CHART_VALUE}=true" in stalled["message"]
    assert stalled["observedGeneration"] == 1
    assert conditions[ConditionType.READY]["status"] == "False"
    assert conditions[ConditionType.RECONCILING]["status"] == "False"
    # nothing but the InferenceService's status: no picker, no ServiceAccount/Role/RoleBinding,
    # not even the pools (they would serve no one without the picker)
    assert _children(fake) == set()
    assert {verb for _, verb in fake.writes} == {"patch status"}
    # one Warning Event per generation, not one per reconcile
    assert [e[:2] for e in events] == [("Warning", Reason.INFERENCE_POOL_DISABLED)]
    run(fake, _pool_obj(mode, generation=2))
    assert [e[:2] for e in events] == [("Warning", Reason.INFERENCE_POOL_DISABLED)] * 2


def test_builtin_router_mode_is_unaffected_by_the_toggle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_testing, "SETTINGS", DISABLED)
    fake = FakeKube()
    fake.ready_replicas = 1
    result, conditions = run(fake, isvc_obj())
    assert result.ready and conditions[ConditionType.STALLED]["status"] == "False"
    assert ("Deployment", "tiny-router") in _children(fake)
    assert not {k for k in _children(fake) if k[0] in ("ServiceAccount", "Role", "RoleBinding", "InferencePool")}


def test_an_operator_restarted_with_the_mode_on_converges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_testing, "SETTINGS", DISABLED)
    fake = FakeKube()
    fake.ready_replicas = 1
    run(fake, _pool_obj())
    monkeypatch.setattr(kube_testing, "SETTINGS", dataclasses.replace(DISABLED, inference_pool=True))
    result, conditions = run(fake)
    assert result.ready and conditions[ConditionType.STALLED]["status"] == "False"
    assert {
        ("InferencePool", "tiny"),
        ("ServiceAccount", "tiny-epp"),
        ("Role", "tiny-epp"),
        ("RoleBinding", "tiny-epp"),
        ("Deployment", "tiny-epp"),
    } <= _children(fake)


# ---------------------------------------------------------------------------- flags
def _parse(*argv: str) -> operator_flags.OperatorArgs:
    return operator_flags.operator_args_from_namespace(main.build_parser().parse_args(list(argv)))


def test_inference_pool_flag_is_off_unless_given() -> None:
    assert _parse().inference_pool is False
    assert _parse("--inference-pool").inference_pool is True
    assert _parse("--no-inference-pool").inference_pool is False


@pytest.mark.parametrize(
    ("value", "namespaces"),
    [
        ("", ()),
        ("team", ("team",)),
        ("a,b", ("a", "b")),
        ("b, a,b,", ("b", "a")),
    ],
)
def test_namespace_flag_lists_the_watched_namespaces(value: str, namespaces: tuple[str, ...]) -> None:
    assert operator_flags.watched_namespaces(_parse(f"--namespace={value}")) == namespaces


@pytest.mark.parametrize("value", ["team-*", "a,!b", "A", "a b", "x" * 64])
def test_namespace_flag_refuses_what_kopf_would_read_as_a_pattern(value: str) -> None:
    # kopf reads namespaces as globs and exclusions: "team-*" would also serve namespaces
    # created later, where the operator has no Role.
    with pytest.raises(ValueError, match="--namespace"):
        operator_flags.watched_namespaces(_parse(f"--namespace={value}"))
    with pytest.raises(SystemExit):
        main.main([f"--namespace={value}"])
