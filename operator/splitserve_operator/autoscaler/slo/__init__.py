"""SLO-driven autoscaling: scale the prefill and decode pools on p99 TTFT and ITL directly.

``spec.autoscaling.slo {ttftP99, itlP99, attainment}`` replaces hand-tuned proxy targets
(queue length, KV usage) with the goal itself. Per round the operator builds
:class:`.inputs.SloInputs` (live pods only), calls :meth:`.state.SloState.observe` and
then :func:`.controller.decide_slo`, which returns the same :class:`..decision.Decision`
target tracking does, with the arithmetic in ``formula`` and the model in ``model``.

Design, one module per job:

* :mod:`.inputs` — the seam: what the operator, the simulator and the tests feed in. The
  engine-step time is linear in five coefficients (step, prefill token, prefill attention
  pair, decode row, decode context token), so a window of the pods' step counters is one
  exact regression point.
* :mod:`.step_fit` — per pool, Bayesian ridge regression on those points (each window a
  relative equation ``θ·x/y ≈ 1``): the planner's roofline is the prior, worth
  :data:`.step_fit.PRIOR_WINDOWS` windows shaped like the data (a Zellner g-prior, so it
  dominates with no data and the data wins after a few windows), exponential forgetting
  (half-life :data:`.step_fit.HALF_LIFE_SECONDS`) plus change detection (a round missing
  the fit by ``max(3 × usual miss, 8 %)`` halves the old data) so drifted pods re-converge
  in minutes, non-negative coefficients, and a confidence
  ``n/(n+k) × max(0, 1 - relative_error/0.5)`` that gates how far decisions rely on it.
  Sufficient statistics only: under 2 KB of JSON.
* :mod:`.forecast` — Holt's linear trend on the request rate (α 0.5, β 0.1), EWMAs of the
  request shape, and the rate's burstiness (mean miss around the trend beyond Poisson
  noise); the horizon is the pod start time the operator measures itself.
* :mod:`.estimate` — closed-form p-quantile TTFT (backlog drain + M/G/c queue wait +
  own chunked prefill + the decode pool's first step) and ITL (Little's-law batch, its
  Poisson quantile, prefill chunks in aggregated steps, KV capacity) at a replica count.
* :mod:`.controller` — per pool the fewest replicas meeting the targets at
  ``(max(current, forecast, recent peak) + 3 × burstiness) ÷ headroom`` (the margin is on the
  load, as the seed's 70-80 % utilisation rule; a backlog counts only beyond one pod start
  time: it must be gone then, not chased with unbounded replicas); reactive scale-up (at
  most doubling the Ready pods) when the measured p99 violates; confidence and an N-1
  check (the model corrected by measured/estimated) gate every scale-down; target
  tracking's counts are floors; then the target tracker's stabilization, Pending-pod
  hold, step limits and bounds (:func:`..decision.settle`), and a joint GPU budget
  granted by marginal SLO gain per GPU.
* :mod:`.state` — everything learned (fits, forecaster, pod start times), one JSON
  document that survives restarts; unreadable → fresh (conservative) state.

Bound to the operator (Kubernetes, Prometheus), and not re-exported here (importing this package stays pure):

* :mod:`.round` — the SLO part of an autoscaling round (:mod:`..loop`): the spec as a
  :class:`.inputs.SloTarget`, the load read from Prometheus, feeding :class:`.state.SloState`,
  the controller's call;
* :mod:`.store` — :class:`.state.SloState` kept in the ``<isvc>-slo-state`` ConfigMap.
* :mod:`.measure` — what the controller reads from Prometheus (step counters, latency
  quantiles, the load).

The rest is pure Python (no numpy, no Kubernetes): the simulator imports this exact code.
"""

from __future__ import annotations

from .controller import MIN_CONFIDENCE_TO_SCALE_DOWN, decide_slo
from .estimate import (
    Backlog,
    DecodeEstimate,
    LatencyEstimate,
    PrefillEstimate,
    Workload,
    estimate_aggregated,
    estimate_decode,
    estimate_disaggregated,
    estimate_prefill,
)
from .forecast import LoadForecaster
from .inputs import (
    COEFFICIENT_NAMES,
    LoadObservation,
    PoolSloObservation,
    SloInputs,
    SloTarget,
    StepCoefficients,
    StepSample,
)
from .state import SloState
from .step_fit import StepFit

__all__ = [
    "COEFFICIENT_NAMES",
    "MIN_CONFIDENCE_TO_SCALE_DOWN",
    "Backlog",
    "DecodeEstimate",
    "LatencyEstimate",
    "LoadForecaster",
    "LoadObservation",
    "PoolSloObservation",
    "PrefillEstimate",
    "SloInputs",
    "SloState",
    "SloTarget",
    "StepCoefficients",
    "StepFit",
    "StepSample",
    "Workload",
    "decide_slo",
    "estimate_aggregated",
    "estimate_decode",
    "estimate_disaggregated",
    "estimate_prefill",
]
