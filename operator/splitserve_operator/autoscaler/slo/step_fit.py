"""Per-pool online fit of the step model: Bayesian ridge regression with forgetting.

Why: the planner's roofline (the prior) is only as good as its hardware numbers; the pods'
own step counters say what a step really costs. Each window of counter deltas of one pod is
one exact point of the linear model of :mod:`.inputs` (``seconds = θ·x``), so a regression
over those points calibrates the model without per-step data leaving the pods.

The estimator keeps sufficient statistics only (a few hundred bytes of JSON)::

    G = Σ w·u·uᵀ   (5×5)      m = Σ w·u      yy = n = Σ w,      u = x / y

i.e. every window is one *relative* equation ``θ·x/y ≈ 1`` (counter noise grows with the
window's busy time ``y``; unweighted least squares would let the busiest windows decide
alone), with ``w = 2^(-age/half_life)`` (exponential forgetting: a pod moved to other hardware or
a new model version re-converges; see :data:`HALF_LIFE_SECONDS`). On top of that, change
detection: when a round's windows miss the current fit by more than
``max(3 × noise, 8 %)`` (median; ``noise`` the usual miss of unsurprising rounds), the old
statistics are halved once more, so a real shift wins within a few rounds instead of a
few half-lives. The posterior mean solves

    (P + G) θ = P θ₀ + m,      P = (k/n) · (G + 0.1 · diag(G))

where ``θ₀`` is the prior and ``k`` = :data:`PRIOR_WINDOWS`: the prior counts as ``k``
pseudo-windows shaped like the data (Zellner's g-prior), so the fit is about
``(n·θ_data + k·θ₀)/(n + k)`` — the prior dominates with no data and the data wins after a
few windows, whatever the features' units (pairs are ~10⁸ per window, steps ~10³); the
small diagonal share keeps directions the data never excited (collinear features) at the
prior. That Zellner prior is as weak along a feature as the data is rich in it, so on top a
floor derived from the prior alone: ``P_jj ≥`` :data:`PRIOR_FLOOR_WINDOWS` ``/ θ0_j²`` (a
fraction of a window made of feature ``j`` alone); without it one nearly decode-only window
let the prefill coefficients absorb the whole miss (a prefill chunk predicted 21,000× too
slow after window 1). A feature never seen (``G_jj = 0``, e.g. prefill tokens on a decode pod) keeps the
prior's value, or 0 without a prior. Without a prior ``P`` is a negligible ridge and the
coefficients stay None until :data:`MIN_POINTS_WITHOUT_PRIOR` windows have been seen and
the system is solvable. Coefficients are constrained to be ``>= 0`` (active-set
non-negative least squares): a step never gets cheaper by doing more work.

Confidence (``[0, 1]``) says how far a decision may rely on the fit::

    confidence = n / (n + k)  ×  max(0, 1 - relative_error / ERROR_SCALE)

the share of real data against the prior's pseudo-windows, times a penalty for how badly
the fitted model explains the data (``relative_error = sqrt(Σw·(1 - θ·x/y)² / Σw)``, the
relative RMS error of the predicted window busy time; ``ERROR_SCALE`` = 0.5, so 10 % error
keeps 80 % of the trust and 50 % error none). No data → 0.

Collinear traffic (prefill and decode work growing together, or prompt tokens and attention
pairs at one prompt length) leaves a direction of ``θ`` the data cannot identify. The
runtime's decode-only counters break the first case: the operator hands a pod's window over
as two points, the steps that computed no prefill chunk and the rest
(:meth:`.inputs.StepSample.split`), which have different mixes (on the tiny Llama on CPU,
windows of the totals alone over-priced a 256-512-token prefill step by 25 % with every
window's busy time right). Whatever direction is left unidentified, the confidence does not
see it, on purpose: (1) along that direction the fit stays at the prior's split (the
diagonal share and the floor), so a step of another mix is predicted between the prior and
the truth, never beyond (``test_collinear_traffic_keeps_the_unidentified_split_between_
prior_and_truth``) — no worse than with no calibration at all;
(2) a pool's decisions predict the pool's own mix at the forecast load, which the data does
identify; (3) when the mix shifts (the bursty trace's prompt-length shift), the new windows
miss the fit, change detection discounts the old data and the new mix separates the
coefficients within a few rounds. Gating on a per-direction posterior variance would
instead hold every pure prefill/decode pool at low confidence (their features are
collinear by construction) and block its scale-downs.

Without a prior (1) does not hold: the unidentified direction has no value at all, only the
ridge's split. That split is put on the step's fixed part rather than on its decode rows
(:data:`ROW_RIDGE_FACTOR`): batch-1 decode windows then price a batch of 8 a little under its
time (0.92x on the test truth) instead of at ~4x (the equal split) — the weights read is the
fixed part of every decode step, and an optimistic price is corrected by the first measured
violation and the larger batches it brings, where a pessimistic one adds pods that keep the
batches small, so the data never corrects it (the SLO e2e without a prior scaled its decode
pool on the forecast so). :meth:`StepFit.confidence_at` is for the same case: the confidence with the
data's share counted as the support of one mix, ``1 / leverage`` of the planned request's
features (normalised by the effective number of parameters, so a mix like the data's has the
support of all of it). Not a per-direction variance: the pool's own mix keeps the fit's full
confidence; only a plan the windows never showed loses it. The controller reads it for
prior-less fits (:func:`.controller._planned_mix`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

from .inputs import COEFFICIENT_NAMES, StepCoefficients, StepSample
from .linalg import Matrix, solve_nonnegative, solve_spd, zeros

HALF_LIFE_SECONDS: Final = 900.0
"""Data older than this counts half (15 min: a drifted pod re-converges within ~30 min;
the steady state keeps ~20 min × pods × 4 windows/min ≫ 5 coefficients of data)."""
PRIOR_WINDOWS: Final = 2.0
"""The prior's weight in windows of data (``k``)."""
ERROR_SCALE: Final = 0.5
"""Relative fit error at which the confidence drops to 0."""
MIN_WINDOW_SECONDS: Final = 0.02
"""Windows with less busy time are too noisy (timer resolution, one step) to count."""
MIN_POINTS_WITHOUT_PRIOR: Final = 3
"""Windows needed before a prior-less fit returns coefficients."""
RIDGE_WITHOUT_PRIOR: Final = 1e-6
"""Ridge (relative to each feature's magnitude) that keeps a prior-less solve defined."""
ROW_RIDGE_FACTOR: Final = 100.0
"""The decode row and context coefficients' ridge, times :data:`RIDGE_WITHOUT_PRIOR`: what
prior-less windows cannot split between a step's fixed part and its rows goes to the step
(module docstring). Still 10⁻⁴ of each feature's own weight: no pull on identified data."""
CHANGE_ERROR_FACTOR: Final = 3.0
CHANGE_MIN_ERROR: Final = 0.08
"""A round off by more than this (and 3× the fit's usual error) signals a changed pod."""
CHANGE_DECAY: Final = 0.5
"""Extra forgetting per surprising round: the old data halves, so a real change wins in a few rounds."""
CHANGE_MIN_WEIGHT: Final = 8.0
NOISE_ALPHA: Final = 0.1
"""Windows of data before change detection is trusted."""
PRIOR_FLOOR_WINDOWS: Final = 0.01
"""Floor of the prior's strength per coefficient: 1/100 of a window whose busy time is that
feature alone, by the prior (precision ``≥ 0.01/θ0_j²``). Independent of the data, so a
feature the data has barely shown cannot move freely (one nearly decode-only window sent a
prefill chunk's prediction 21,000x off without it, 0.5x with it); a feature with share
``s`` of the busy time outweighs it after ``0.01/s²`` windows (10 %: one window, 1 %:
100), so calibration of the features that matter is not slowed (2x-too-fast prior: 13
windows to 10 %, as before)."""
PRIOR_DIAGONAL: Final = 0.1
"""Share of the prior's weight kept on the diagonal (pins directions the data never excites)."""
FORMAT_VERSION: Final = 1

_N = len(COEFFICIENT_NAMES)


class StepFit:
    """One pool's fitted step model (see the module docstring)."""

    def __init__(
        self,
        *,
        prior: StepCoefficients | None,
        gram: Matrix,
        moment: list[float],
        yy: float,
        weight: float,
        points: int,
        last_seconds: float | None,
        half_life_seconds: float = HALF_LIFE_SECONDS,
        noise: float | None = None,
    ) -> None:
        self.prior = prior.bounded() if prior is not None else None
        self._gram = gram
        self._moment = moment
        self._yy = yy
        self._weight = weight
        self._points = points
        self._last_seconds = last_seconds
        self.half_life_seconds = half_life_seconds
        self.noise = noise
        """EWMA of unsurprising rounds' median relative residual (change detection's baseline)."""
        self._cache: tuple[StepCoefficients | None] | None = None

    @classmethod
    def fresh(cls, *, prior: StepCoefficients | None, half_life_seconds: float = HALF_LIFE_SECONDS) -> StepFit:
        """No data yet: the coefficients are the prior's (or None), the confidence 0."""
        return cls(
            prior=prior,
            gram=zeros(_N),
            moment=[0.0] * _N,
            yy=0.0,
            weight=0.0,
            points=0,
            last_seconds=None,
            half_life_seconds=half_life_seconds,
        )

    # ------------------------------------------------------------------ updating
    def set_prior(self, prior: StepCoefficients | None) -> None:
        """Replace the prior (the spec's changed) and keep the data."""
        prior = prior.bounded() if prior is not None else None
        if prior != self.prior:
            self.prior = prior
            self._cache = None

    def add(self, samples: Sequence[StepSample], *, now_seconds: float) -> None:
        """Forget by the time since the last call, then add the windows that ran steps."""
        if self._last_seconds is not None and now_seconds > self._last_seconds:
            self._scale(0.5 ** ((now_seconds - self._last_seconds) / self.half_life_seconds))
        if self._last_seconds is None or now_seconds > self._last_seconds:
            self._last_seconds = now_seconds
        usable = [s for s in samples if _usable(s)]
        if usable and self._surprised(usable):
            self._scale(CHANGE_DECAY)
        for sample in usable:
            # Relative weighting (w = 1/y²): the counters' noise is proportional to the
            # window's busy time, so each window counts as one relative-error equation.
            y = sample.seconds
            x = [v / y for v in sample.features()]
            if not all(math.isfinite(v * v) for v in x):
                continue  # counters no engine produces (a window of 10¹⁵⁵ steps): the sums would overflow
            for i in range(_N):
                self._moment[i] += x[i]
                for j in range(_N):
                    self._gram[i][j] += x[i] * x[j]
            self._yy += 1.0
            self._weight += 1.0
            self._points += 1
        self._cache = None

    def _scale(self, decay: float) -> None:
        self._gram = [[v * decay for v in row] for row in self._gram]
        self._moment = [v * decay for v in self._moment]
        self._yy *= decay
        self._weight *= decay
        self._cache = None

    def _surprised(self, samples: Sequence[StepSample]) -> bool:
        """Change detection: the new windows' median relative residual against the current
        fit exceeds ``max(CHANGE_ERROR_FACTOR × noise, CHANGE_MIN_ERROR)``, where ``noise`` is
        an EWMA of that residual over the rounds that were not surprising (the fit's error
        before a change; the fit's own error would grow with the mixed data and hide it)."""
        theta = self.coefficients
        if theta is None or self._weight < CHANGE_MIN_WEIGHT:
            return False
        t = theta.as_tuple()
        residuals = sorted(
            abs(s.seconds - sum(c * v for c, v in zip(t, s.features(), strict=True))) / s.seconds for s in samples
        )
        median = residuals[len(residuals) // 2]
        noise = self.noise if self.noise is not None else (self.relative_error or 0.0)
        if median > max(CHANGE_ERROR_FACTOR * noise, CHANGE_MIN_ERROR):
            return True
        self.noise = median if self.noise is None else NOISE_ALPHA * median + (1.0 - NOISE_ALPHA) * self.noise
        return False

    # ------------------------------------------------------------------ reading
    @property
    def points(self) -> int:
        """Windows added so far (not decayed)."""
        return self._points

    @property
    def weight(self) -> float:
        """Effective number of windows after forgetting (``n``)."""
        return self._weight

    @property
    def coefficients(self) -> StepCoefficients | None:
        """The posterior mean; the prior with no data; None with neither (or no solution)."""
        if self._cache is None:
            self._cache = (self._solve(),)
        return self._cache[0]

    @property
    def relative_error(self) -> float | None:
        """``sqrt(Σw·(1 - θ·x/y)² / Σw)`` of the fitted coefficients; None with no data."""
        theta = self.coefficients
        if theta is None or self._yy <= 0.0:
            return None
        t = theta.as_tuple()
        fitted = sum(t[i] * self._moment[i] for i in range(_N))
        quad = sum(t[i] * self._gram[i][j] * t[j] for i in range(_N) for j in range(_N))
        return math.sqrt(max(0.0, self._yy - 2.0 * fitted + quad) / self._yy)

    @property
    def confidence(self) -> float:
        """``n/(n+k) × max(0, 1 - relative_error/ERROR_SCALE)`` in ``[0, 1]``."""
        error = self.relative_error
        if error is None or self._weight <= 0.0:
            return 0.0
        share = self._weight / (self._weight + PRIOR_WINDOWS)
        return max(0.0, min(1.0, share * max(0.0, 1.0 - error / ERROR_SCALE)))

    def support(self, features: Sequence[float]) -> float:
        """Effective windows of data behind the prediction at ``features`` (a window's or a
        step's feature vector): ``1 / (uᵀ (G + P)⁻¹ u)`` with ``u = x / (θ·x)``, the inverse
        leverage of that point. A mix like the data's has the support of all of it (``n``
        windows of one mix: ``n``); a mix along a direction the data never excited has
        next to none without a prior (the ridge alone bounds it: batch-1 decode windows
        cannot say what a batch of 16 costs, steps and decode rows being the same count
        in every one of them). With a prior that direction stays at the prior's split and
        the support counts the prior's pseudo-windows. 0 without coefficients."""
        theta = self.coefficients
        if theta is None or self._weight <= 0.0:
            return 0.0
        predicted = sum(c * v for c, v in zip(theta.as_tuple(), features, strict=True))
        if not predicted > 0.0 or not math.isfinite(predicted):
            return 0.0
        u = [v / predicted for v in features]
        precision, _ = self._precision()
        a = [[self._gram[i][j] + precision[i][j] for j in range(_N)] for i in range(_N)]
        # a feature neither the data nor the prior has (all-zero row) cannot be in ``u``
        # of a prediction that needs it: drop it from the solve
        keep = [j for j in range(_N) if a[j][j] > 0.0]
        if any(u[j] != 0.0 for j in range(_N) if j not in keep):
            return 0.0
        # in unit-diagonal coordinates, as the solve: the features' scales differ by 10⁸
        d = {j: math.sqrt(a[j][j]) for j in keep}
        scaled_a = [[a[i][j] / (d[i] * d[j]) for j in keep] for i in keep]
        scaled_u = [u[j] / d[j] for j in keep]
        v = solve_spd(scaled_a, scaled_u)
        if v is None:
            return 0.0
        leverage = sum(x * y for x, y in zip(scaled_u, v, strict=True))
        # the data's own mean leverage is (effective parameters) / n: normalise by the
        # effective parameters, trace((G + P)⁻¹ G), so a mix like the data's has support n
        parameters = 0.0
        for k, j in enumerate(keep):
            column = solve_spd(scaled_a, [self._gram[i][j] / (d[i] * d[j]) for i in keep])
            if column is None:
                return 0.0
            parameters += column[k]
        return max(parameters, 1.0) / leverage if leverage > 0.0 else math.inf

    def confidence_at(self, features: Sequence[float]) -> float:
        """:attr:`confidence` with the data's share counted as the support of this mix
        (:meth:`support`) where that is smaller: how far a prediction at ``features`` may
        be relied on. Equal to :attr:`confidence` for a mix like the data's."""
        error = self.relative_error
        if error is None or self._weight <= 0.0:
            return 0.0
        windows = min(self._weight, self.support(features))
        share = windows / (windows + PRIOR_WINDOWS)
        return max(0.0, min(self.confidence, share * max(0.0, 1.0 - error / ERROR_SCALE)))

    def _precision(self) -> tuple[Matrix, tuple[float, ...]]:
        """``(P, θ₀)`` of the module docstring (a negligible ridge and zeros without a prior)."""
        theta0 = self.prior.as_tuple() if self.prior is not None else (0.0,) * _N
        n = self._weight
        if self.prior is not None:
            # Zellner-style: the prior is PRIOR_WINDOWS windows shaped like the data (k·G/n),
            # plus a little on the diagonal for directions the data has not excited.
            precision = [
                [PRIOR_WINDOWS * self._gram[i][j] / n * (1.0 + (PRIOR_DIAGONAL if i == j else 0.0)) for j in range(_N)]
                for i in range(_N)
            ]
            # Floor from the prior itself: at least PRIOR_FLOOR_WINDOWS windows made of
            # feature j alone (u_j = 1/θ0_j), so a feature barely present in the data so far
            # cannot absorb the whole miss of the windows it is barely in.
            for j in range(_N):
                if theta0[j] > 0.0:
                    precision[j][j] = max(precision[j][j], PRIOR_FLOOR_WINDOWS / (theta0[j] * theta0[j]))
        else:
            per_row = {COEFFICIENT_NAMES.index("decode_row"), COEFFICIENT_NAMES.index("decode_context")}
            precision = [
                [
                    RIDGE_WITHOUT_PRIOR * (ROW_RIDGE_FACTOR if i in per_row else 1.0) * self._gram[i][j]
                    if i == j
                    else 0.0
                    for j in range(_N)
                ]
                for i in range(_N)
            ]
        return precision, theta0

    def _solve(self) -> StepCoefficients | None:
        if self._weight <= 0.0:
            return self.prior
        if self.prior is None and self._points < MIN_POINTS_WITHOUT_PRIOR:
            return None
        precision, theta0 = self._precision()
        # Normalised coordinates z_j = D_j θ_j so that the solve sees unit diagonals.
        diag = [math.sqrt(self._gram[j][j] + precision[j][j]) for j in range(_N)]
        a = [
            [
                (self._gram[i][j] + precision[i][j]) / (diag[i] * diag[j]) if diag[i] > 0 and diag[j] > 0 else 0.0
                for j in range(_N)
            ]
            for i in range(_N)
        ]
        pull = [sum(precision[i][j] * theta0[j] for j in range(_N)) for i in range(_N)]
        b = [(self._moment[i] + pull[i]) / diag[i] if diag[i] > 0 else 0.0 for i in range(_N)]
        z = solve_nonnegative(a, b, fixed=[0.0] * _N) if all(map(math.isfinite, b)) else None
        if z is None:
            return self.prior
        theta = [z[j] / diag[j] if self._gram[j][j] > 0 and diag[j] > 0 else max(0.0, theta0[j]) for j in range(_N)]
        if not all(math.isfinite(v) for v in theta):
            return self.prior  # never a NaN or Infinity into the estimates, the status or the ConfigMap
        return StepCoefficients.from_tuple(theta)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, object]:
        """JSON-ready sufficient statistics (plus the derived values, for humans)."""
        theta = self.coefficients
        return {
            "version": FORMAT_VERSION,
            "prior": list(self.prior.as_tuple()) if self.prior is not None else None,
            "gram": [v for row in self._gram for v in row],
            "moment": list(self._moment),
            "yy": self._yy,
            "weight": self._weight,
            "points": self._points,
            "lastSeconds": self._last_seconds,
            "halfLifeSeconds": self.half_life_seconds,
            "noise": self.noise,
            "coefficients": dict(zip(COEFFICIENT_NAMES, theta.as_tuple(), strict=True)) if theta else None,
            "confidence": round(self.confidence, 4),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> StepFit:
        """Inverse of :meth:`to_dict`; ``ValueError`` on anything malformed."""
        try:
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown step fit version {data.get('version')!r}")
            prior_raw = data.get("prior")
            prior = StepCoefficients.from_tuple(_floats(prior_raw, _N)) if prior_raw is not None else None
            flat = _floats(data["gram"], _N * _N)
            last, noise = data.get("lastSeconds"), data.get("noise")
            return cls(
                prior=prior,
                gram=[flat[i * _N : (i + 1) * _N] for i in range(_N)],
                moment=_floats(data["moment"], _N),
                yy=_float(data["yy"]),
                weight=_float(data["weight"]),
                points=int(_float(data["points"])),
                last_seconds=None if last is None else _float(last),
                half_life_seconds=_float(data.get("halfLifeSeconds", HALF_LIFE_SECONDS)),
                noise=None if noise is None else _float(noise),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed step fit: {error}") from error


def _usable(sample: StepSample) -> bool:
    """A window that ran steps, with finite non-negative counters."""
    values = (*sample.features(), sample.seconds)
    return (
        sample.steps > 0 and sample.seconds >= MIN_WINDOW_SECONDS and all(math.isfinite(v) and v >= 0 for v in values)
    )


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _floats(value: object, length: int) -> list[float]:
    if not isinstance(value, list) or len(value) != length:
        raise ValueError(f"expected a list of {length} numbers")
    return [_float(v) for v in value]
