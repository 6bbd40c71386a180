"""What the SLO controller would read from the simulated fleet at an autoscaler tick.

Why here: the controller (:mod:`splitserve_operator.autoscaler.slo`) must see the simulated pods
exactly as it sees real ones through Prometheus — engine-step counter *deltas* per live pod
(:class:`StepSample`), gauges summed over live pods, latency quantiles over the window and the
arrival stream — or the simulator would test a different controller. So the engine keeps the
runtime's counters per pod (:class:`~.state.StepCounters`) and this mixin only takes window
differences and quantiles, as the operator's queries do.

Live pods only: a pod the autoscaler removed is draining and no longer in ``pools``, so its
counters drop out of the next window (the scaled-away-series lesson); a pod that became ready
during the window reports its counters from zero.
"""

from __future__ import annotations

import collections
import itertools
import math

import numpy as np

from splitserve_operator.autoscaler.slo.inputs import (
    LoadObservation,
    PoolSloObservation,
    SloInputs,
    StepSample,
)

from ..workload import Request
from .state import Pod, SimState


def _quantile(values: list[float], q: float) -> float | None:
    return float(np.quantile(np.asarray(values), q)) if values else None


def _weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float | None:
    if not pairs:
        return None
    values = np.asarray([v for v, _ in pairs])
    weights = np.asarray([w for _, w in pairs])
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    if cum[-1] <= 0:
        return None
    idx = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(values[order][min(idx, len(values) - 1)])


class WindowObserver(SimState):
    """Per-tick :class:`SloInputs`: counter deltas since the previous tick, live pods only."""

    _last_counters: dict[int, tuple[float, ...]]
    _last_tick_s: float
    _last_prefill_counts: tuple[int, int]
    _last_load: LoadObservation | None
    _arrival_history: collections.deque[Request]
    """With an observation lag: the arrivals not yet out of every window a later round reads."""

    def _init_observer(self) -> None:
        self.observing = True
        self._last_counters = {}
        self._last_tick_s = self.now
        self._last_prefill_counts = (0, 0)
        self._last_load = None
        self._arrival_history = collections.deque()

    def _step_samples(self, pod: Pod) -> list[StepSample]:
        """The pod's window as the operator reads it: its decode-only part and the rest."""
        now = pod.counters.snapshot()
        before = self._last_counters.get(pod.index, (0.0,) * len(now))
        self._last_counters[pod.index] = now
        delta = [a - b for a, b in zip(now, before, strict=True)]
        if delta[0] <= 0:
            return []
        window = StepSample(
            steps=delta[0],
            seconds=delta[1],
            prefill_tokens=delta[2],
            prefill_attention_pairs=delta[3],
            decode_rows=delta[4],
            decode_context_tokens=delta[5],
        )
        return window.split(
            decode_only_steps=delta[6],
            decode_only_seconds=delta[7],
            decode_only_rows=delta[8],
            decode_only_context_tokens=delta[9],
        )

    def _pool_observation(self, role: str, *, ttft: float | None, itl: float | None) -> PoolSloObservation:
        pods = self.pools[role]
        samples = [s for p in pods for s in self._step_samples(p)]
        waiting_prompt = sum(j.num_tokens - j.num_computed for p in pods for j in p.waiting if not j.kv_ready)
        return PoolSloObservation(
            role=role,
            current_replicas=len(pods) + self.starting[role],
            ready_replicas=len(pods),
            pending_replicas=0,
            step_samples=samples,
            requests_waiting=float(sum(len(p.waiting) for p in pods)),
            prompt_tokens_waiting=float(waiting_prompt),
            requests_running=float(sum(p.num_running for p in pods)),
            kv_cache_usage_ratio=sum(p.kv_used / p.capacity for p in pods) / max(len(pods), 1),
            kv_cache_tokens_per_replica=float(pods[0].capacity if pods else self.perf.kv_capacity_tokens),
            ttft_p99_seconds=ttft,
            itl_p99_seconds=itl,
        )

    def _observed_arrivals(self, window: float) -> list[Request]:
        """The arrivals of the window the round reads: the last ``window`` seconds, or with an
        observation lag (:attr:`.SimOptions.observation_lag_seconds`) the window ending that
        long ago."""
        lag = self.options.observation_lag_seconds
        if lag <= 0:
            return self.window_arrivals
        self._arrival_history.extend(self.window_arrivals)
        end = self.now - lag
        while self._arrival_history and self._arrival_history[0].arrival_seconds < end - window:
            self._arrival_history.popleft()
        return list(itertools.takewhile(lambda r: r.arrival_seconds < end, self._arrival_history))

    def _load_observation(self, window: float) -> LoadObservation | None:
        arrivals = self._observed_arrivals(window)
        role = self.entry_role
        counts = (self.prefill_computed[role], self.prefill_cached[role])
        computed = counts[0] - self._last_prefill_counts[0]
        cached = counts[1] - self._last_prefill_counts[1]
        self._last_prefill_counts = counts
        if window <= 0:
            return self._last_load
        if arrivals:
            prompt = sum(r.num_prompt_tokens for r in arrivals) / len(arrivals)
            output = sum(r.num_output_tokens for r in arrivals) / len(arrivals)
        elif self._last_load is not None:  # a quiet window keeps the last sizes
            prompt, output = self._last_load.prompt_tokens_mean, self._last_load.output_tokens_mean
        else:
            return None
        hit = (
            cached / (cached + computed)
            if cached + computed > 0
            else (self._last_load.prefix_hit_ratio if self._last_load is not None else 0.0)
        )
        self._last_load = LoadObservation(
            window_seconds=window,
            request_rate=len(arrivals) / window,
            prompt_tokens_mean=prompt,
            output_tokens_mean=output,
            prefix_hit_ratio=min(max(hit, 0.0), 1.0),
        )
        return self._last_load

    def _observe_window(self, *, quantile: float) -> SloInputs:
        """The inputs of one SLO round, then a new window starts. TTFT is the service's (its
        first tokens), reported on the pool that admits requests; ITL on the pool that decodes."""
        window = self.now - self._last_tick_s
        ttft = _quantile(self.window_ttft, quantile)
        itl = _weighted_quantile(self.window_itl, quantile)
        pools: dict[str, PoolSloObservation] = {}
        for role in self.pools:
            pools[role] = self._pool_observation(
                role,
                ttft=ttft if role == self.entry_role else None,
                itl=itl if role in ("decode", "aggregated") else None,
            )
        load = self._load_observation(window)
        live = {p.index for pods in self.pools.values() for p in pods}
        self._last_counters = {i: c for i, c in self._last_counters.items() if i in live}
        self.window_ttft.clear()
        self.window_itl.clear()
        self.window_arrivals.clear()
        self._last_tick_s = self.now
        return SloInputs(now_seconds=self.now, pools=pools, load=load)


def gpu_seconds(pods: list[Pod], *, start_s: float, end_s: float, gpus_per_replica: int) -> float:
    """GPU-seconds the pods held within ``[start_s, end_s]``: from creation (a starting pod holds
    its GPU) until drained (or the end)."""
    total = 0.0
    for pod in pods:
        gone = end_s if pod.gone_s < 0 else min(pod.gone_s, end_s)
        total += max(0.0, gone - max(pod.born_s, start_s))
    return total * gpus_per_replica if math.isfinite(total) else math.inf
