"""``CalibratedStepCost``: the simulator prices steps with the SLO controller's fitted coefficients.

Pure decode steps map exactly onto the step model; a prompt's chunk is off by at most its
sampled row priced as a decode row. One request on an idle simulated pod then takes exactly the
model's prefill time to its first token and the model's decode step time per later token.
"""

from __future__ import annotations

import numpy as np
import pytest

from splitserve_operator.autoscaler.slo.inputs import StepCoefficients
from splitserve_planner.calibrated_model import CalibratedStepCost
from splitserve_planner.perf_model import (
    decode_step_seconds,
    prefill_attention_pairs,
    prefill_seconds,
)
from splitserve_planner.simulator import (
    AGGREGATED,
    EngineSettings,
    FleetConfig,
    SimOptions,
    simulate,
)
from splitserve_planner.workload import Request

THETA = StepCoefficients(step=1e-3, prefill_token=2e-5, prefill_pair=3e-8, decode_row=6e-5, decode_context=4e-7)


def _model(theta: StepCoefficients = THETA) -> CalibratedStepCost:
    return CalibratedStepCost(coefficients=theta, kv_capacity_tokens=100_000, kv_bytes_per_token=1024)


def test_a_decode_step_is_priced_exactly() -> None:
    seconds = decode_step_seconds(_model(), batch_size=16, num_context_tokens=16 * 300)
    assert seconds == pytest.approx(THETA.step + 16 * THETA.decode_row + 16 * 300 * THETA.decode_context)


@pytest.mark.parametrize(("tokens", "cached"), [(1, 0), (256, 0), (512, 0), (128, 1024)])
def test_a_prompt_is_priced_within_one_row(tokens: int, cached: int) -> None:
    exact = (
        THETA.step
        + tokens * THETA.prefill_token
        + prefill_attention_pairs(num_new_tokens=tokens, num_computed_tokens=cached) * THETA.prefill_pair
    )
    seconds = prefill_seconds(_model(), num_tokens=tokens + cached, num_cached_tokens=cached)
    # the sampled row is priced as a decode row; cached context as decode context (module docstring)
    slack = abs(THETA.decode_row - THETA.prefill_token) + cached * (THETA.decode_context + THETA.prefill_pair)
    assert abs(seconds - exact) <= slack + 1e-12
    assert seconds >= THETA.step


def test_doubling_the_coefficients_doubles_every_step() -> None:
    fast, slow = _model(), _model(THETA.scaled(2.0))
    for shape in (
        {"num_tokens": 300, "num_seqs": 5, "num_attention_pairs": 50_000, "num_kv_tokens": 1200},
        {"num_tokens": 8, "num_seqs": 8, "num_attention_pairs": 4008, "num_kv_tokens": 4000},
    ):
        assert slow.step_seconds(**shape) == pytest.approx(2 * fast.step_seconds(**shape))


def test_rejects_negative_coefficients_and_empty_capacity() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        CalibratedStepCost(coefficients=THETA.scaled(-1.0), kv_capacity_tokens=10, kv_bytes_per_token=1)
    with pytest.raises(ValueError, match=">= 1"):
        CalibratedStepCost(coefficients=THETA, kv_capacity_tokens=0, kv_bytes_per_token=1)


def test_one_request_on_an_idle_pod_takes_the_models_step_times() -> None:
    prompt, output = 200, 6
    fleet = FleetConfig(
        mode=AGGREGATED,
        aggregated_replicas=1,
        engine=EngineSettings(max_num_seqs=8, max_batched_tokens=512, prefix_caching=False),
    )
    result = simulate(
        fleet=fleet, perf=_model(), requests=[Request(0, 0.0, prompt, output)], options=SimOptions(macro_steps=False)
    )
    ttft = prefill_seconds(_model(), num_tokens=prompt)
    assert result.ttft_percentile(50) == pytest.approx(ttft)
    gaps = [THETA.step + THETA.decode_row + (prompt + j) * THETA.decode_context for j in range(output - 1)]
    assert np.sort(result.itl_values_seconds) == pytest.approx(sorted(gaps))
