"""SLO attainment of a simulated run: the fraction of requests meeting both latency targets.

Why its own module: ``splitserve plan --slo`` (:mod:`.slo_plan`) reports it for the planned
fleet, and the benchmark that compares autoscaling policies (``bench/splitserve_bench``) scores
every policy with it; one definition keeps the plan's figure and the benchmark's comparable.
"""

from __future__ import annotations

import numpy as np

from splitserve_operator.autoscaler.slo.inputs import SloTarget


def meets(*, ttft: np.ndarray, tpot: np.ndarray, slo: SloTarget) -> np.ndarray:
    """Per finished request: TTFT and mean inter-token latency both within their targets."""
    return np.asarray((ttft <= slo.ttft_p99_seconds) & (tpot <= slo.itl_p99_seconds), dtype=bool)


def attainment(*, ttft: np.ndarray, tpot: np.ndarray, num_requests: int, slo: SloTarget) -> float:
    """Fraction of ``num_requests`` meeting both targets (the arrays hold the finished ones)."""
    if num_requests == 0:
        return 1.0
    return int(np.count_nonzero(meets(ttft=ttft, tpot=tpot, slo=slo))) / num_requests
