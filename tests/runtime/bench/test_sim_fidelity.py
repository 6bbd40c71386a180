"""The fleet simulator on the calibrated step model reproduces the real runtime's TTFT and ITL.

``bench/sim_fidelity.py`` at CI size: the real engine (tiny Llama, CPU, in-process) is
calibrated by the SLO controller's own fit (:class:`StepFit`, no prior) from its engine-step
counters (closed-loop windows at six levels plus a run of the same kind of traffic), then serves
two seeded Poisson workloads with continuous batching; the simulator runs the same requests on
one aggregated pod priced by :class:`splitserve_planner.calibrated_model.CalibratedStepCost`.
The median absolute percentage error over TTFT and ITL p50/p99 of both levels (the MAPE) must
stay within :data:`BOUND`, and the same model 2x too fast or 2x too slow must miss it.

Clock: the bench's ``model`` clock. The engine really runs every step (scheduling, chunked
prefill, batching, sampling, counting), but each step is given the duration a fixed step model
assigns to the work the engine's counters counted, times seeded noise (σ 0.1). On this shared
2-core machine the measured time itself does not reproduce: the same workload run twice
back to back differs by a median 14 % over these figures in CPU time and 32 % in wall time
(other tenants' load drifts the speed by ±25 % within a minute), so a bound on measured time
could not both pass and reject a 2x error. What this checks is everything else: that the
simulator schedules, batches and queues as the runtime does, that the counters count the work
the simulator prices, and that the controller's fit recovers the step model from them.
Measured here: MAPE 3.8-4.5 % (2x too fast 55 %, 2x too slow 175 %); the bench prints the
wall- and CPU-clock figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_bench

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # ~25 s on one core (calibration and two workloads)

BOUND = 0.15


def test_simulator_matches_the_real_runtime_on_the_calibrated_model(tiny_llama_dir: Path) -> None:
    bench = load_bench("sim_fidelity")
    torch.set_num_threads(1)
    calibration, levels = bench.measure(
        model_dir=tiny_llama_dir, rates=(15.0, 35.0), seconds=5.0, calibration_seconds=4.0, clock="model"
    )
    print("\n" + bench.report(calibration, levels))
    assert [level.requests for level in levels] == [67, 177]  # the seeded workloads
    # the counters → fit pipeline recovers the model the steps took (busy time of each run)
    assert all(abs(level.busy_error) < 0.05 for level in levels), [level.busy_error for level in levels]
    mape = {variant: bench.mape(levels, variant) for variant in bench.VARIANTS}
    assert mape["2x fast"] > BOUND and mape["2x slow"] > BOUND, f"the bound does not tell a 2x error apart: {mape}"
    assert mape["calibrated"] <= BOUND, f"simulated vs real TTFT/ITL p50/p99: MAPE {mape}"
