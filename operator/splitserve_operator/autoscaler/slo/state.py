"""What the SLO controller remembers per InferenceService, and how it survives restarts.

Why one object: the fitted step models, the load forecaster and the measured pod start
times are all learned from the service's own history; losing them on an operator restart
would send the controller back to the prior (and zero confidence). :meth:`SloState.to_json`
is small (a few KB) so the operator can keep it in a ConfigMap (or the status) and
:meth:`SloState.from_json` never raises: a corrupt or unknown document gives a fresh state,
which is merely conservative (no model-driven scale-down until confidence is rebuilt).

Pod start time (the forecast horizon) is measured, per role, from the operator's own
writes: :meth:`record_replicas_write` notes ``(time, replicas)`` of a scale-up and
:meth:`observe` closes it when that role's Ready count reaches the written count; the
elapsed time feeds an EWMA (α = 0.5). Writes never satisfied within
:data:`PENDING_WRITE_EXPIRY_SECONDS` (pods Pending for GPUs) are dropped unmeasured.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Final

from .forecast import LoadForecaster
from .inputs import SloInputs, SloTarget
from .step_fit import StepFit

DEFAULT_POD_START_SECONDS: Final = 120.0
"""Horizon before the first measurement (a model load of a few GB from a warm cache)."""
MIN_POD_START_SECONDS: Final = 5.0
MAX_POD_START_SECONDS: Final = 1800.0
PENDING_WRITE_EXPIRY_SECONDS: Final = 1800.0
START_ALPHA: Final = 0.5
FORMAT_VERSION: Final = 1


@dataclasses.dataclass
class SloState:
    """Fits per pool, the forecaster, and pod start times per role (see the module docstring)."""

    fits: dict[str, StepFit] = dataclasses.field(default_factory=dict)
    """Per pool name (the keys of :attr:`SloInputs.pools`)."""
    forecaster: LoadForecaster = dataclasses.field(default_factory=LoadForecaster)
    start_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured pod start time per role (EWMA)."""
    pending_writes: dict[str, list[tuple[float, int]]] = dataclasses.field(default_factory=dict)
    """Scale-up writes per role not yet Ready: ``(time_seconds, replicas)``."""
    ready: dict[str, int] = dataclasses.field(default_factory=dict)
    """Ready replicas per role at the last :meth:`observe`."""
    waiting: dict[str, float] = dataclasses.field(default_factory=dict)
    """Requests waiting per pool at the last :meth:`observe`."""
    waiting_before: dict[str, float] = dataclasses.field(default_factory=dict)
    """Requests waiting per pool at the :meth:`observe` before the last: with :attr:`waiting`,
    whether a pool's queue is draining (the controller's passing-violation rule)."""

    @classmethod
    def fresh(cls) -> SloState:
        return cls()

    # ------------------------------------------------------------------ learning
    def observe(self, inputs: SloInputs, slo: SloTarget) -> None:
        """Feed this round into the fits and the forecaster; close pod-start measurements.

        Call once per round, before :func:`.controller.decide_slo`.
        """
        for name, pool in inputs.pools.items():
            fit = self.fits.get(name)
            if fit is None:
                fit = self.fits[name] = StepFit.fresh(prior=slo.prior)
            fit.set_prior(slo.prior)
            fit.add(pool.step_samples, now_seconds=inputs.now_seconds)
            if name in self.waiting:
                self.waiting_before[name] = self.waiting[name]
            self.waiting[name] = max(0.0, pool.requests_waiting)
            for key in {pool.role, name}:  # writes may be recorded by role or by pool name
                self._close_writes(key, ready=pool.ready_replicas, now_seconds=inputs.now_seconds)
                self.ready[key] = pool.ready_replicas
        if inputs.load is not None:
            self.forecaster.update(inputs.load, now_seconds=inputs.now_seconds)

    def record_replicas_write(self, role: str, now_seconds: float, replicas: int) -> None:
        """The operator wrote ``replicas`` for ``role``'s pool; a scale-up starts a measurement."""
        writes = [w for w in self.pending_writes.get(role, []) if w[1] < replicas]
        if replicas > self.ready.get(role, 0):
            writes.append((now_seconds, replicas))
        self.pending_writes[role] = writes

    def pod_start_seconds(self, role: str) -> float:
        """Measured replicas-write → Ready time of ``role`` (the forecast horizon)."""
        return self.start_seconds.get(role, DEFAULT_POD_START_SECONDS)

    def _close_writes(self, role: str, *, ready: int, now_seconds: float) -> None:
        writes = self.pending_writes.get(role)
        if not writes:
            return
        done = [w for w in writes if w[1] <= ready]
        self.pending_writes[role] = [
            w for w in writes if w[1] > ready and now_seconds - w[0] <= PENDING_WRITE_EXPIRY_SECONDS
        ]
        if done:
            elapsed = now_seconds - max(w[0] for w in done)
            measured = min(MAX_POD_START_SECONDS, max(MIN_POD_START_SECONDS, elapsed))
            previous = self.start_seconds.get(role)
            self.start_seconds[role] = (
                measured if previous is None else (START_ALPHA * measured + (1.0 - START_ALPHA) * previous)
            )

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> str:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "fits": {name: fit.to_dict() for name, fit in sorted(self.fits.items())},
                "forecaster": self.forecaster.to_dict(),
                "startSeconds": dict(sorted(self.start_seconds.items())),
                "pendingWrites": {
                    role: [list(w) for w in writes] for role, writes in sorted(self.pending_writes.items())
                },
                "ready": dict(sorted(self.ready.items())),
                "waiting": dict(sorted(self.waiting.items())),
                "waitingBefore": dict(sorted(self.waiting_before.items())),
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | None) -> SloState:
        """Inverse of :meth:`to_json`; anything unreadable gives :meth:`fresh` (never raises)."""
        if not text:
            return cls.fresh()
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
                return cls.fresh()
            return cls(
                fits={str(name): StepFit.from_dict(_mapping(fit)) for name, fit in _mapping(data["fits"]).items()},
                forecaster=LoadForecaster.from_dict(_mapping(data["forecaster"])),
                start_seconds={str(k): _finite(v) for k, v in _mapping(data.get("startSeconds", {})).items()},
                pending_writes={
                    str(role): [(_finite(w[0]), int(_finite(w[1]))) for w in writes]
                    for role, writes in _mapping(data.get("pendingWrites", {})).items()
                },
                ready={str(k): int(_finite(v)) for k, v in _mapping(data.get("ready", {})).items()},
                waiting={str(k): _finite(v) for k, v in _mapping(data.get("waiting", {})).items()},
                waiting_before={str(k): _finite(v) for k, v in _mapping(data.get("waitingBefore", {})).items()},
            )
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return cls.fresh()


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("expected an object")
    return value


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)
