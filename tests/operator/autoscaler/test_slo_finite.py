"""The SLO controller never produces a number JSON cannot carry, whatever prior it is given.

The defect pinned here: ``spec.autoscaling.slo.prior`` of 1e308 (finite, so admitted) turned
the fitted coefficients into Infinity; the status patch then carried ``Infinity``, which the
API server refuses, every round, so the status stayed frozen at ``ScalingActive=True``. The
rounds below run against an in-memory API server that serializes every write the way the
real one parses it (no NaN, no Infinity: ``json.dumps(..., allow_nan=False)``).
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Mapping
from typing import Any

import pytest
from slo_testing import TRUTH, window
from test_slo_loop import NAME, NOW, SelectingKube, busy_prometheus, cluster, isvc, replicas, round_

import splitserve_contract as contract
from splitserve_operator import kube
from splitserve_operator.api import InferenceService, InvalidSpecError
from splitserve_operator.autoscaler.slo import StepCoefficients, StepFit, StepSample
from splitserve_operator.autoscaler.slo.inputs import (
    COEFFICIENT_NAMES,
    MAX_COEFFICIENT_SECONDS,
    SloTarget,
)
from splitserve_operator.autoscaler.slo.state import SloState
from splitserve_operator.autoscaler.slo.store import SloStore

HUGE = StepCoefficients(step=1e308, prefill_token=1e308, prefill_pair=1e308, decode_row=1e308, decode_context=1e308)
TINY = StepCoefficients(
    step=1e-300, prefill_token=1e-300, prefill_pair=1e-300, decode_row=1e-300, decode_context=1e-300
)


class StrictKube(SelectingKube):  # type: ignore[misc]  # a test module's class: Any to mypy
    """:class:`SelectingKube` whose writes are serialized as the API server reads them: a body
    with NaN or Infinity is refused (400), as kube-apiserver refuses ``Infinity``."""

    def __init__(self, base: SelectingKube) -> None:
        super().__init__()
        self.fake = base.fake
        self.refused: list[str] = []

    def _check(self, body: Mapping[str, Any]) -> None:
        try:
            json.dumps(body, allow_nan=False)
        except ValueError as exc:
            self.refused.append(str(exc))
            from kube_testing import api_error

            raise api_error(400, "BadRequest", f"invalid JSON: {exc}") from exc

    def merge_patch(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        self._check(patch)
        written: dict[str, Any] = super().merge_patch(
            kind=kind, namespace=namespace, name=name, patch=patch, subresource=subresource, field_manager=field_manager
        )
        return written

    def apply(self, *, obj: Mapping[str, Any], field_manager: str, force: bool) -> dict[str, Any]:
        self._check(obj)
        result: dict[str, Any] = self.fake.apply(obj=obj, field_manager=field_manager, force=force)
        return result


def _with_prior(obj: dict[str, Any], prior: StepCoefficients) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["spec"]["autoscaling"]["slo"]["prior"] = {
        "step": prior.step,
        "prefillToken": prior.prefill_token,
        "prefillPair": prior.prefill_pair,
        "decodeRow": prior.decode_row,
        "decodeContext": prior.decode_context,
    }
    return out


def _numbers(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, Mapping):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def test_a_prior_beyond_the_bound_is_refused_at_admission() -> None:
    """The CRD and the model refuse a coefficient over the bound (1e308 wedged the autoscaler:
    every status patch carried Infinity); the autoscaler still bounds whatever it is given."""
    with pytest.raises(InvalidSpecError) as refused:
        InferenceService.parse(_with_prior(isvc(), HUGE))
    assert "prior" in str(refused.value) and "less than or equal to 60" in str(refused.value)


AT_THE_BOUND = StepCoefficients(**dict.fromkeys(COEFFICIENT_NAMES, MAX_COEFFICIENT_SECONDS))


@pytest.mark.parametrize("prior", [AT_THE_BOUND, TINY], ids=["60s-per-unit", "1e-300"])
def test_an_absurd_prior_still_gets_every_round_into_the_status(prior: StepCoefficients) -> None:
    api = StrictKube(cluster(_with_prior(isvc(), prior)))
    prom, store = busy_prometheus(), SloStore()
    for i in range(3):
        decisions = round_(api, prom, store=store, now=NOW + 15 * i)
        assert set(decisions) == {"prefill", "decode"}
    assert api.refused == []
    status = api.objects[(contract.KIND, NAME)]["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ScalingActive"]["status"] == "True", conditions["ScalingActive"]
    for role in ("prefill", "decode"):
        model = status[role]["lastDecision"]["model"]
        assert model and all(math.isfinite(v) for v in model.values()), model
        assert all(
            v <= MAX_COEFFICIENT_SECONDS
            for k, v in model.items()
            if k in ("step", "prefillToken", "prefillPair", "decodeRow", "decodeContext")
        )
        assert replicas(api, role) == decisions[role].result
    # the fit survives a restart: its ConfigMap holds only finite numbers, so it reads back
    saved = api.objects[("ConfigMap", f"{NAME}-slo-state")]["data"]["state.json"]
    assert "Infinity" not in saved and "NaN" not in saved
    assert SloState.from_json(saved).fits["decode"].points >= 1


def test_a_prior_is_bounded_where_the_fit_stays_finite() -> None:
    assert HUGE.bounded() == StepCoefficients.from_tuple([MAX_COEFFICIENT_SECONDS] * 5)
    assert TINY.bounded() == StepCoefficients.from_tuple([0.0] * 5)
    assert TRUTH.bounded() == TRUTH  # realistic priors are untouched
    assert SloTarget(ttft_p99_seconds=0.5, itl_p99_seconds=0.05, prior=HUGE).prior == HUGE.bounded()
    assert StepFit.fresh(prior=HUGE).prior == HUGE.bounded()


@pytest.mark.parametrize("prior", [HUGE, TINY, None], ids=["1e308", "1e-300", "none"])
def test_the_fit_stays_finite_with_any_prior(prior: StepCoefficients | None) -> None:
    rng = random.Random(3)
    fit = StepFit.fresh(prior=prior)
    for i in range(12):
        fit.add([window(rng, TRUTH, role="aggregated")], now_seconds=15.0 * i)
        theta = fit.coefficients
        assert theta is not None or prior is None
        if theta is not None:
            assert all(math.isfinite(v) for v in theta.as_tuple()), theta
        assert math.isfinite(fit.confidence)
    assert all(math.isfinite(n) for n in _numbers(json.loads(json.dumps(fit.to_dict()))))
    json.dumps(fit.to_dict(), allow_nan=False)


def test_counters_no_engine_produces_do_not_overflow_the_fit() -> None:
    fit = StepFit.fresh(prior=TRUTH)
    fit.add(
        [
            StepSample(
                steps=1e200,
                seconds=1.0,
                prefill_tokens=1e200,
                prefill_attention_pairs=1e200,
                decode_rows=1e200,
                decode_context_tokens=1e200,
            )
        ],
        now_seconds=0.0,
    )
    theta = fit.coefficients
    assert theta is not None and all(math.isfinite(v) for v in theta.as_tuple())
    json.dumps(fit.to_dict(), allow_nan=False)
