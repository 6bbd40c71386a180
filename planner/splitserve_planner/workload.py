"""Request streams for the simulator: Poisson, bursty (2-state MMPP) or a replayed trace CSV.

A request is its arrival time, prompt and output token counts, and optionally a prefix group:
requests of one group start with the same ``num_prefix_tokens`` tokens (a shared system
prompt), which a pod's prefix cache can serve. Synthetic prompts of grouped requests are the
group prefix followed by a unique part drawn from the prompt-length distribution.

Generation is seeded and *coupled across rates*: request ``i`` has the same sizes and group
whatever the rate, and arrival times are unit-rate times divided by the rate. So "more load"
compares the same requests arriving faster, which keeps planner answers monotone in load.

Trace CSV columns (header required): ``timestamp`` (seconds), ``prompt_tokens``,
``output_tokens``, optional ``prefix_group`` (empty: none) and ``prefix_tokens``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LENGTH_KINDS = ("fixed", "exponential", "lognormal", "uniform")


@dataclass(slots=True)
class Request:
    request_id: int
    arrival_seconds: float
    num_prompt_tokens: int
    num_output_tokens: int
    prefix_group: int = -1
    """-1: no shared prefix."""
    num_prefix_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """A token-count distribution: ``fixed:N``, ``exponential:MEAN``, ``lognormal:MEAN:SIGMA``
    or ``uniform:LOW:HIGH``; samples are clamped to ``[1, max_tokens]``."""

    kind: str
    mean: float
    sigma: float = 0.0
    low: int = 1
    high: int = 0
    max_tokens: int = 1 << 20

    @classmethod
    def parse(cls, text: str, *, max_tokens: int = 1 << 20) -> LengthDist:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                return cls(kind="fixed", mean=float(int(parts[0])), max_tokens=max_tokens)._check(text)
            kind, args = parts[0], [float(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(
                f"bad token distribution {text!r}: use N, fixed:N, exponential:MEAN, "
                "lognormal:MEAN:SIGMA or uniform:LOW:HIGH"
            ) from None
        if kind == "fixed" and len(args) == 1:
            return cls(kind=kind, mean=args[0], max_tokens=max_tokens)._check(text)
        if kind == "exponential" and len(args) == 1:
            return cls(kind=kind, mean=args[0], max_tokens=max_tokens)._check(text)
        if kind == "lognormal" and len(args) == 2:
            return cls(kind=kind, mean=args[0], sigma=args[1], max_tokens=max_tokens)._check(text)
        if kind == "uniform" and len(args) == 2:
            low, high = int(args[0]), int(args[1])
            return cls(kind=kind, mean=(low + high) / 2, low=low, high=high, max_tokens=max_tokens)._check(text)
        raise ValueError(
            f"bad token distribution {text!r}: use N, fixed:N, exponential:MEAN, "
            "lognormal:MEAN:SIGMA or uniform:LOW:HIGH"
        )

    def _check(self, text: str) -> LengthDist:
        if self.mean < 1 or self.sigma < 0 or (self.kind == "uniform" and not 1 <= self.low <= self.high):
            raise ValueError(f"bad token distribution {text!r}: lengths must be >= 1")
        return self

    def sample(self, rng: np.random.Generator, *, count: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(count, self.mean)
        elif self.kind == "exponential":
            values = np.ceil(rng.exponential(self.mean, size=count))
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2  # so that the mean is `mean`
            values = np.rint(rng.lognormal(mu, self.sigma, size=count))
        else:
            values = rng.integers(self.low, self.high + 1, size=count).astype(float)
        clipped: np.ndarray = np.clip(values, 1, self.max_tokens).astype(np.int64)
        return clipped


@dataclass(frozen=True, kw_only=True)
class Arrivals:
    """``poisson`` at ``rate_per_second``, or ``bursty``: a 2-state MMPP whose states last
    ``burst_seconds`` on average each and whose high rate is ``burst_factor`` × the low one,
    with the same mean rate."""

    rate_per_second: float
    kind: str = "poisson"
    burst_factor: float = 4.0
    burst_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not self.rate_per_second > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate_per_second}")
        if self.kind not in ("poisson", "bursty"):
            raise ValueError(f"unknown arrival process {self.kind!r}; choose poisson or bursty")
        if self.burst_factor < 1 or self.burst_seconds <= 0:
            raise ValueError("burst factor must be >= 1 and burst seconds > 0")

    def times(self, rng: np.random.Generator, *, duration_seconds: float) -> np.ndarray:
        """Arrival times in ``[0, duration)``, from unit-rate draws scaled by the rate."""
        if self.kind == "poisson":
            return _poisson_times(rng, rate=self.rate_per_second, duration_seconds=duration_seconds)
        low = 2 * self.rate_per_second / (1 + self.burst_factor)
        rates = (low * self.burst_factor, low)
        out: list[np.ndarray] = []
        start, state = 0.0, 0
        while start < duration_seconds:
            dwell = float(rng.exponential(self.burst_seconds))
            end = min(start + dwell, duration_seconds)
            out.append(start + _poisson_times(rng, rate=rates[state], duration_seconds=end - start))
            start, state = end, 1 - state
        return np.concatenate(out) if out else np.zeros(0)


def _poisson_times(rng: np.random.Generator, *, rate: float, duration_seconds: float) -> np.ndarray:
    expected = rate * duration_seconds
    count = int(expected + 6 * math.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0, size=count)) / rate
    while times[-1] < duration_seconds:  # astronomically rare
        more = times[-1] + np.cumsum(rng.exponential(1.0, size=count)) / rate
        times = np.concatenate([times, more])
    return times[times < duration_seconds]


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """A synthetic workload."""

    arrivals: Arrivals
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    prefix_share: float = 0.0
    """Fraction of requests that start with one of ``prefix_groups`` shared prefixes."""
    prefix_tokens: int = 0
    prefix_groups: int = 8

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError(f"prefix share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_share > 0 and (self.prefix_tokens < 1 or self.prefix_groups < 1):
            raise ValueError("a prefix share needs --prefix-tokens >= 1 and --prefix-groups >= 1")

    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens.mean + self.prefix_share * self.prefix_tokens

    def generate(self, *, duration_seconds: float, seed: int) -> list[Request]:
        times = self.arrivals.times(np.random.default_rng(seed), duration_seconds=duration_seconds)
        count = len(times)
        sizes = np.random.default_rng([seed, 1])  # independent of the arrival stream: coupled
        prompts = self.prompt_tokens.sample(sizes, count=count)
        outputs = self.output_tokens.sample(np.random.default_rng([seed, 2]), count=count)
        groups_rng = np.random.default_rng([seed, 3])
        shared = groups_rng.random(count) < self.prefix_share
        groups = groups_rng.integers(0, max(self.prefix_groups, 1), size=count)
        out: list[Request] = []
        for i in range(count):
            if shared[i]:
                out.append(
                    Request(
                        i,
                        float(times[i]),
                        int(prompts[i]) + self.prefix_tokens,
                        int(outputs[i]),
                        int(groups[i]),
                        self.prefix_tokens,
                    )
                )
            else:
                out.append(Request(i, float(times[i]), int(prompts[i]), int(outputs[i])))
        return out


def load_trace(*, path: Path, default_prefix_tokens: int = 0) -> list[Request]:
    """Read a trace CSV (see the module docstring); ValueError names the line and the field."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from exc
    with handle:
        reader = csv.DictReader(handle)
        fields = set(reader.fieldnames or ())
        missing = {"timestamp", "prompt_tokens", "output_tokens"} - fields
        if missing:
            raise ValueError(
                f"trace {path}: missing column(s) {', '.join(sorted(missing))} "
                "(need timestamp,prompt_tokens,output_tokens[,prefix_group,prefix_tokens])"
            )
        rows: list[Request] = []
        for line, row in enumerate(reader, start=2):
            try:
                ts = float(row["timestamp"])
                prompt = int(row["prompt_tokens"])
                output = int(row["output_tokens"])
                group_text = (row.get("prefix_group") or "").strip()
                group = int(group_text) if group_text else -1
                prefix_text = (row.get("prefix_tokens") or "").strip()
                prefix = int(prefix_text) if prefix_text else (default_prefix_tokens if group >= 0 else 0)
            except ValueError as exc:
                raise ValueError(f"trace {path} line {line}: {exc}") from None
            if not math.isfinite(ts) or ts < 0 or prompt < 1 or output < 1 or prefix < 0 or group < -1:
                raise ValueError(f"trace {path} line {line}: timestamp must be >= 0 and token counts >= 1")
            rows.append(Request(0, ts, prompt, output, group, min(prefix, prompt - 1) if group >= 0 else 0))
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    rows.sort(key=lambda r: r.arrival_seconds)
    start = rows[0].arrival_seconds
    for i, r in enumerate(rows):
        r.request_id, r.arrival_seconds = i, r.arrival_seconds - start
    return rows
