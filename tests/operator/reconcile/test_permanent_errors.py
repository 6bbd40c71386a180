"""Issue 12 #12: a spec that can never apply is Stalled/InvalidSpec, not retried for ever.

The API server refuses some children for good (422 Invalid, 400 BadRequest, and the 500
"failed to create typed patch object" of a server-side apply that does not fit the schema).
The reconciler used to report those as ApiError with Reconciling=True and raise for kopf to
retry with back-off, forever. Now: Stalled=True, reason InvalidSpec, the API server's
message, one Warning Event, no exception, and no further API call until the generation
changes. Transient errors (5xx, 409, timeouts) are still retried."""

from __future__ import annotations

import pytest
from kube_testing import FakeKube, api_error, isvc_obj, record_events, run
from kubernetes.client.exceptions import ApiException

from splitserve_contract import ConditionType, Reason
from splitserve_operator import apierrors, reconcile

UNPROCESSABLE = (
    'Deployment.apps "tiny-engine" is invalid: spec.template.spec.affinity.nodeAffinity.'
    "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0]."
    "values: Required value: must be specified when `operator` is 'In' or 'NotIn'"
)
TYPED_PATCH = (
    "failed to create typed patch object (n/tiny-engine; apps/v1, Kind=Deployment): "
    ".spec.template.spec.tolerations[0].foo: field not declared in schema"
)


@pytest.mark.parametrize(
    ("error", "permanent"),
    [
        (api_error(422, "Invalid", UNPROCESSABLE), True),
        (api_error(400, "BadRequest", 'strict decoding error: unknown field "spec.foo"'), True),
        (api_error(500, "InternalError", TYPED_PATCH), True),
        (api_error(500, "InternalError", "etcdserver: request timed out"), False),
        (api_error(503, "ServiceUnavailable", "the server is currently unable to handle the request"), False),
        (api_error(409, "Conflict", "the object has been modified"), False),
        (api_error(429, "TooManyRequests", "slow down"), False),
        (api_error(403, "Forbidden", 'exceeded quota: "compute"'), False),
        (api_error(404, "NotFound", 'namespaces "n" not found'), False),
        (ApiException(status=500, reason="Internal Server Error"), False),  # no body
        (TimeoutError("read timed out"), False),
        (ConnectionResetError("reset"), False),
    ],
    ids=lambda v: str(getattr(v, "status", v)) if not isinstance(v, bool) else str(v),
)
def test_which_errors_a_retry_cannot_fix(error: BaseException, permanent: bool) -> None:
    assert apierrors.is_permanent(error) is permanent


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    recorded: list[tuple[str, str, str]] = record_events(monkeypatch)
    return recorded


@pytest.mark.parametrize(
    "error",
    [api_error(422, "Invalid", UNPROCESSABLE), api_error(500, "InternalError", TYPED_PATCH)],
    ids=["422", "typed-patch-500"],
)
def test_a_child_refused_for_good_stalls_with_invalid_spec(
    posted: list[tuple[str, str, str]], error: ApiException
) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = error
    result, conds = run(fake)  # before the fix: RetryableError, ApiError, Reconciling=True
    assert result.outcome == Reason.INVALID_SPEC
    stalled, reconciling, ready = (
        conds[t] for t in (ConditionType.STALLED, ConditionType.RECONCILING, ConditionType.READY)
    )
    assert (stalled["status"], stalled["reason"]) == ("True", Reason.INVALID_SPEC)
    assert (reconciling["status"], ready["status"]) == ("False", "False")
    assert "Deployment/tiny-engine" in stalled["message"]
    assert apierrors.status_message(error) in stalled["message"]  # the API server's own words
    assert stalled["observedGeneration"] == 1
    assert fake.objects[("InferenceService", "tiny")]["status"]["observedGeneration"] == 1
    assert [(t, r) for t, r, _ in posted] == [("Warning", Reason.INVALID_SPEC)]


def test_an_invalid_generation_is_not_retried_until_the_spec_changes(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = api_error(422, "Invalid", UNPROCESSABLE)
    run(fake)
    writes_before, events_before = len(fake.writes), len(posted)
    for _ in range(3):  # kopf resumes, child events, a restarted operator: all the same generation
        result, conds = run(fake)
        assert result.outcome == Reason.INVALID_SPEC
    assert fake.writes[writes_before:] == [] and len(posted) == events_before
    assert conds[ConditionType.STALLED]["reason"] == Reason.INVALID_SPEC
    # A new generation (the user fixed the spec) is applied again, and converges.
    del fake.errors["Deployment/tiny-engine"]
    result, conds = run(fake, isvc_obj(generation=2))
    assert result.outcome == Reason.PROGRESSING
    assert (conds[ConditionType.STALLED]["status"], conds[ConditionType.STALLED]["observedGeneration"]) == ("False", 2)


def test_a_new_invalid_generation_gets_its_own_event(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = api_error(422, "Invalid", UNPROCESSABLE)
    run(fake)
    run(fake, isvc_obj(generation=2))
    assert [(t, r) for t, r, _ in posted] == [("Warning", Reason.INVALID_SPEC)] * 2


def test_transient_errors_are_still_retried(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = api_error(503, "ServiceUnavailable", "try again")
    with pytest.raises(reconcile.RetryableError, match="try again"):
        run(fake)
    conds = {c["type"]: c for c in fake.objects[("InferenceService", "tiny")]["status"]["conditions"]}
    assert (conds[ConditionType.STALLED]["status"], conds[ConditionType.STALLED]["reason"]) == (
        "False",
        Reason.API_ERROR,
    )
    assert conds[ConditionType.RECONCILING]["status"] == "True"
    with pytest.raises(reconcile.RetryableError):  # and again: nothing makes it stop retrying
        run(fake)


def test_a_permanent_error_wins_over_a_transient_one(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = api_error(422, "Invalid", UNPROCESSABLE)
    fake.errors["Service/tiny-router"] = api_error(503, "ServiceUnavailable", "try again")
    result, conds = run(fake)  # retrying could not make the spec apply
    assert result.outcome == Reason.INVALID_SPEC
    assert "try again" not in conds[ConditionType.STALLED]["message"]


def test_a_spec_the_models_refuse_is_not_retried_either(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    bad = isvc_obj(tolerations=[{"foo": "bar"}])  # slipped past an older CRD
    result, conds = run(fake, bad)
    assert result.outcome == Reason.INVALID_SPEC
    assert "tolerations[0]" in conds[ConditionType.STALLED]["message"]
    writes = len(fake.writes)
    run(fake)
    assert len(fake.writes) == writes
    assert [(t, r) for t, r, _ in posted] == [("Warning", Reason.INVALID_SPEC)]


def test_a_models_verdict_does_not_outlive_an_operator_upgrade(posted: list[tuple[str, str, str]]) -> None:
    """An operator that read the object through a newer CRD (a field its models do not know
    yet) stored Stalled/InvalidSpec at this generation. The upgraded operator, whose models
    accept the spec, must reconcile it without waiting for a spec change."""
    fake = FakeKube()
    bad = isvc_obj(tolerations=[{"foo": "bar"}])  # what the old operator's models refused
    result, conds = run(fake, bad)
    assert result.outcome == Reason.INVALID_SPEC
    assert not conds[ConditionType.STALLED]["message"].startswith(reconcile.API_REFUSED_PREFIX)
    # same generation, the spec the new operator reads (its models accept it)
    result, conds = run(fake, isvc_obj())
    assert result.outcome == Reason.PROGRESSING
    assert (conds[ConditionType.STALLED]["status"], conds[ConditionType.STALLED]["reason"]) != (
        "True",
        Reason.INVALID_SPEC,
    )
    assert fake.objects[("Deployment", "tiny-engine")]  # children applied


def test_the_api_servers_verdict_is_marked_as_its_own(posted: list[tuple[str, str, str]]) -> None:
    fake = FakeKube()
    fake.errors["Deployment/tiny-engine"] = api_error(422, "Invalid", UNPROCESSABLE)
    _, conds = run(fake)
    assert conds[ConditionType.STALLED]["message"].startswith(reconcile.API_REFUSED_PREFIX)
    assert reconcile.spec_never_applies(fake.objects[("InferenceService", "tiny")])
