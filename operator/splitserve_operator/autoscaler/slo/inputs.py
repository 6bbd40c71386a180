"""What the SLO controller reads: the shared input types of :mod:`.` (operator loop, simulator, tests).

Why a separate module: three producers build these values — the operator's Prometheus
queries (:mod:`..signals`), the fleet simulator (:mod:`splitserve_planner.sim`) and the
calibration tests that drive the real runtime — and one consumer decides from them
(:mod:`.controller`). Keeping the types here, pure and free of Kubernetes, is the seam.

The step model is linear in its coefficients on purpose: an engine step's time is the
planner's roofline sum (GEMM part + attention part + fixed overhead) linearised, so the
*sums* of the runtime's step counters over a window obey the same equation as one step::

    seconds = step·steps + prefill_token·prefill_tokens + prefill_pair·prefill_attention_pairs
              + decode_row·decode_rows + decode_context·decode_context_tokens

and a window of counter deltas per pod is one exact regression point (no per-step samples
need to leave the pod; Prometheus counters are enough).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Final

from splitserve_contract import defaults

COEFFICIENT_NAMES: tuple[str, ...] = ("step", "prefill_token", "prefill_pair", "decode_row", "decode_context")
"""Order of :class:`StepCoefficients` fields and of :meth:`StepSample.features`."""
MAX_COEFFICIENT_SECONDS: Final = defaults.SLO_MAX_COEFFICIENT_SECONDS
"""The largest coefficient a prior is taken at (:meth:`StepCoefficients.bounded`), whatever the
CRD admitted (see the contract's definition for why)."""
MIN_COEFFICIENT_SECONDS: Final = 1e-20
"""A prior coefficient below this is taken as 0 (:meth:`StepCoefficients.bounded`): it is 0 for
every estimate, and the fit's floor ``0.01/θ0²`` overflows for coefficients below ~1e-154."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCoefficients:
    """Seconds per unit of each step feature (see the module docstring)."""

    step: float
    """Fixed cost of one engine step (launches, scheduling, sampling)."""
    prefill_token: float
    """Per new (uncached) prompt token computed: the linear layers' GEMMs."""
    prefill_pair: float
    """Per causal (query, key) pair of prefill attention: the quadratic part of long prompts."""
    decode_row: float
    """Per decoding sequence in a step: its GEMM row, LM head and sampling."""
    decode_context: float
    """Per context token a decoding sequence attends to: the KV read."""

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in COEFFICIENT_NAMES)

    @classmethod
    def from_tuple(cls, values: Sequence[float]) -> StepCoefficients:
        return cls(**dict(zip(COEFFICIENT_NAMES, values, strict=True)))

    def bounded(self) -> StepCoefficients:
        """These coefficients as a prior is used: each within :data:`MAX_COEFFICIENT_SECONDS`
        (an infinite one too), one below :data:`MIN_COEFFICIENT_SECONDS` (or NaN, or negative)
        as 0. What the CRD admits is not trusted to keep the fit finite."""

        def bound(value: float) -> float:
            if math.isnan(value) or value < MIN_COEFFICIENT_SECONDS:
                return 0.0
            return min(value, MAX_COEFFICIENT_SECONDS)

        return StepCoefficients.from_tuple([bound(v) for v in self.as_tuple()])

    def scaled(self, factor: float) -> StepCoefficients:
        """Every coefficient times ``factor`` (a prior 2x too fast is ``true.scaled(0.5)``)."""
        return StepCoefficients.from_tuple([v * factor for v in self.as_tuple()])


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSample:
    """Engine-step counter deltas of one pod over one window (one regression point).

    Maps to the runtime counters ``splitserve_engine_steps_total``,
    ``splitserve_engine_step_seconds_total``, ``splitserve_engine_prefill_tokens_total``,
    ``splitserve_engine_prefill_attention_pairs_total``, ``splitserve_engine_decode_rows_total``
    and ``splitserve_engine_decode_context_tokens_total`` (increase over the window).
    """

    steps: float
    seconds: float
    """Wall time spent inside engine steps (busy time, not idle time)."""
    prefill_tokens: float
    prefill_attention_pairs: float
    decode_rows: float
    decode_context_tokens: float

    def features(self) -> tuple[float, ...]:
        """The regressors, in :data:`COEFFICIENT_NAMES` order."""
        return (
            self.steps,
            self.prefill_tokens,
            self.prefill_attention_pairs,
            self.decode_rows,
            self.decode_context_tokens,
        )

    def split(
        self,
        *,
        decode_only_steps: float,
        decode_only_seconds: float,
        decode_only_rows: float,
        decode_only_context_tokens: float,
    ) -> list[StepSample]:
        """This window as two regression points: its decode-only steps (the runtime's
        ``splitserve_engine_decode_only_*_total`` increases) and the rest (the totals minus
        those). On an aggregated pod prefill and decode work grow together from window to
        window, so the totals alone leave a prefill token's and a decode row's cost
        unidentified; the two parts have different mixes. A window with no decode-only step or
        nothing but decode-only steps, or whose decode-only part does not fit inside the totals
        (counters read at slightly different instants), is one point, unsplit."""
        if decode_only_steps <= 0 or decode_only_steps >= self.steps:
            return [self]  # no decode-only step, or nothing else: one mix
        rest = StepSample(
            steps=self.steps - decode_only_steps,
            seconds=self.seconds - decode_only_seconds,
            prefill_tokens=self.prefill_tokens,
            prefill_attention_pairs=self.prefill_attention_pairs,
            decode_rows=self.decode_rows - decode_only_rows,
            decode_context_tokens=self.decode_context_tokens - decode_only_context_tokens,
        )
        if min(rest.seconds, rest.decode_rows, rest.decode_context_tokens) < 0:
            return [self]
        decode_only = StepSample(
            steps=decode_only_steps,
            seconds=decode_only_seconds,
            prefill_tokens=0.0,
            prefill_attention_pairs=0.0,
            decode_rows=decode_only_rows,
            decode_context_tokens=decode_only_context_tokens,
        )
        return [decode_only, rest]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSloObservation:
    """One pool at one autoscaling round, live (Ready) pods only."""

    role: str
    """``prefill``, ``decode`` or ``aggregated``."""
    current_replicas: int
    ready_replicas: int
    pending_replicas: int
    """Pods Pending for lack of GPUs (no scale-up beyond current while any exist)."""
    step_samples: Sequence[StepSample]
    """One per live pod that ran steps in the window."""
    requests_waiting: float
    """Summed over live pods, now."""
    prompt_tokens_waiting: float
    """Uncached prompt tokens waiting, summed over live pods, now."""
    requests_running: float
    kv_cache_usage_ratio: float
    """Mean over live pods."""
    kv_cache_tokens_per_replica: float
    """KV capacity of one pod in tokens (blocks × block size); 0 when unknown."""
    ttft_p99_seconds: float | None
    """Measured over the window from the pods' histograms (None: no requests finished)."""
    itl_p99_seconds: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadObservation:
    """The service's workload over the last window."""

    window_seconds: float
    request_rate: float
    """Requests arriving per second."""
    prompt_tokens_mean: float
    output_tokens_mean: float
    prefix_hit_ratio: float
    """Prompt tokens served from the prefix cache / prompt tokens queried, in [0, 1]."""
    recent_prompt_tokens_mean: float | None = None
    recent_output_tokens_mean: float | None = None
    """The same means over the last autoscaling interval only (None: not read, or no request
    then): the newest requests' mix, which the planned load's part above the window's rate is
    sized with (:func:`.controller._plan_load`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SloTarget:
    """``spec.autoscaling.slo``, in seconds."""

    ttft_p99_seconds: float
    itl_p99_seconds: float
    attainment: float = 0.99
    """Fraction of requests that must meet both targets."""
    headroom: float = 0.8
    """Size each pool to meet the targets at the planned request rate ÷ ``headroom``: the planned load
    uses at most this fraction of the rate the fleet serves within the targets (the seed's 70-80 %
    utilisation rule, as the planner's ``--headroom``): the margin for bursts and model error."""
    prior: StepCoefficients | None = None
    """Starting point of the fit (``splitserve plan --slo`` writes the roofline's); None: no prior,
    the fit starts with zero confidence and decisions rely on measured latency until it has data.
    Kept :meth:`~StepCoefficients.bounded`, whatever it was given."""

    def __post_init__(self) -> None:
        if self.prior is not None:
            object.__setattr__(self, "prior", self.prior.bounded())


@dataclasses.dataclass(frozen=True, kw_only=True)
class SloInputs:
    """Everything one SLO round reads."""

    now_seconds: float
    pools: Mapping[str, PoolSloObservation]
    load: LoadObservation | None
    """None when the load could not be read this round (the controller holds)."""
