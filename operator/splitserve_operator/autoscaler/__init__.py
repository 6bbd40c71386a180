"""The autoscaler: scales each pool of an InferenceService from the runtime's metrics.

Layers, each talking only down:

* :mod:`.loop` -- one round per object (:func:`~.loop.run_once`) and the operator-wide loop
  that drives the rounds without a finalizer (:func:`~.loop.register`, called by the
  operator's start-up in :mod:`splitserve_operator.main`);
* :mod:`.observe` (Deployments and pods), :mod:`.signals` (Prometheus),
  :mod:`.actuator` (the only workload writes), :mod:`.metrics` (our own series),
  :mod:`.memory` (in-memory recommendation history);
* :mod:`.slo` -- the SLO autoscaler, all of it in one folder: its pure controller, the
  part of a round that feeds it (:mod:`.slo.round`) and its ConfigMap store
  (:mod:`.slo.store`);
* :mod:`.decision` -- the pure target-tracking rules, with time passed in.

Reasons are :class:`splitserve_contract.Reason` (one definition for the whole project).

Only :mod:`.decision` is re-exported here, so importing the package needs neither kopf
nor a Kubernetes client.
"""

from .decision import (
    Behavior,
    Decision,
    MetricsUnavailable,
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
    plan_joint,
)

__all__ = [
    "Behavior",
    "Decision",
    "MetricsUnavailable",
    "PoolPolicy",
    "RecommendationHistory",
    "SignalValue",
    "decide",
    "plan_joint",
]
