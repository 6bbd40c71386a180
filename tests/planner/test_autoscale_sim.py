"""The simulator driving the operator's own autoscaling decision through a burst."""

from __future__ import annotations

import numpy as np

from splitserve_operator.autoscaler.decision import Decision
from splitserve_planner.perf_model import RooflineModel
from splitserve_planner.simulator import (
    DISAGGREGATED,
    AutoscaleSettings,
    FleetConfig,
    SimOptions,
    Simulator,
)
from splitserve_planner.workload import Request


def _burst() -> list[Request]:
    rng = np.random.default_rng(0)
    out: list[Request] = []
    t = 0.0
    for until, rate in ((60.0, 2.0), (180.0, 40.0), (600.0, 2.0)):
        while t < until:
            t += float(rng.exponential(1 / rate))
            out.append(Request(len(out), t, 4000, 300))
    return out


def test_autoscaler_scales_up_for_a_burst_and_back_down(llama8b_h100: RooflineModel) -> None:
    settings = AutoscaleSettings(
        interval_seconds=15, startup_seconds=30, scale_down_stabilization_seconds=60, max_replicas=16
    )
    fleet = FleetConfig(mode=DISAGGREGATED, prefill_replicas=1, decode_replicas=1, autoscale=settings)
    sim = Simulator(fleet=fleet, perf=llama8b_h100, requests=_burst(), options=SimOptions(sample_interval_seconds=5))
    result = sim.run()
    decisions = sim.scaler.decisions
    assert decisions and all(isinstance(d, Decision) for d in decisions)
    assert any(d.reason == "ScaledUp" and d.pool == "prefill" for d in decisions)
    prefill = [row["prefill_replicas"] for row in result.timeline]
    peak = max(prefill)
    assert peak >= 3
    during = [row["prefill_replicas"] for row in result.timeline if 150 <= row["time_s"] <= 180]
    after = [row["prefill_replicas"] for row in result.timeline if row["time_s"] >= 550]
    assert max(during) == peak
    assert after and after[-1] < peak  # scaled back down once the burst was over
    assert result.num_unfinished == 0
