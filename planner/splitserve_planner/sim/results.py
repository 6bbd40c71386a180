"""What a run reports: timeline samples, per-pool statistics, latencies and their percentiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .state import SimState


@dataclass(kw_only=True)
class PoolStats:
    role: str
    replicas: int
    busy_fraction: float
    """Time spent running steps / (time × replicas)."""
    mean_decode_batch: float
    """Decoding sequences per pod, averaged over time."""
    batch_occupancy: float
    """mean_decode_batch / max_num_seqs, over the time a pod is busy."""
    mean_kv_usage: float
    prefill_tokens_computed: int
    prefill_tokens_cached: int
    preemptions: int
    decode_tokens: int
    """Tokens produced by decode steps (all pods, whole run)."""


@dataclass(kw_only=True)
class SimResult:
    """Latencies (seconds), goodput and utilization of one run."""

    num_measured: int
    num_unfinished: int
    ttft_seconds: np.ndarray
    prefill_side_seconds: np.ndarray
    """Arrival to the end of prefill (disaggregated; equals TTFT when aggregated)."""
    tpot_seconds: np.ndarray
    arrival_seconds: np.ndarray
    """Arrival time of each finished request, aligned with ``ttft_seconds`` and ``tpot_seconds``
    (when the misses happened: the SLO comparison attributes them to what a policy could reach)."""
    e2e_seconds: np.ndarray
    queue_seconds: np.ndarray
    itl_values_seconds: np.ndarray
    itl_weights: np.ndarray
    measured_seconds: float
    num_gpus: int
    pools: dict[str, PoolStats]
    timeline: list[dict[str, float]]
    num_events: int
    wall_seconds: float
    sim_seconds: float
    output_tokens: int

    def ttft_percentile(self, q: float) -> float:
        return _percentile(self.ttft_seconds, q, unfinished=self.num_unfinished)

    def e2e_percentile(self, q: float) -> float:
        return _percentile(self.e2e_seconds, q, unfinished=self.num_unfinished)

    def tpot_percentile(self, q: float) -> float:
        return _percentile(self.tpot_seconds, q, unfinished=self.num_unfinished)

    def itl_percentile(self, q: float) -> float:
        """Per-token inter-token latency percentile (every token after the first)."""
        if self.num_unfinished and q >= 100.0 * (1 - self.num_unfinished / max(self.num_measured, 1)):
            return math.inf
        return _weighted_percentile(self.itl_values_seconds, self.itl_weights, q)

    def goodput(self, *, ttft_slo_seconds: float, tpot_slo_seconds: float) -> float:
        """Requests/s per GPU that met both SLOs (TTFT, and mean time per output token)."""
        ok = int(np.count_nonzero((self.ttft_seconds <= ttft_slo_seconds) & (self.tpot_seconds <= tpot_slo_seconds)))
        return ok / self.measured_seconds / max(self.num_gpus, 1)

    def throughput_requests_per_second(self) -> float:
        return len(self.ttft_seconds) / self.measured_seconds

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for q in (50, 90, 99):
            out[f"ttft_p{q}_ms"] = 1000 * self.ttft_percentile(q)
            out[f"itl_p{q}_ms"] = 1000 * self.itl_percentile(q)
            out[f"e2e_p{q}_ms"] = 1000 * self.e2e_percentile(q)
        out["unfinished"] = float(self.num_unfinished)
        out["requests"] = float(self.num_measured)
        return out


def _percentile(values: np.ndarray, q: float, *, unfinished: int) -> float:
    total = len(values) + unfinished
    if total == 0:
        return math.nan
    if unfinished:
        rank = q / 100.0 * (total - 1)
        if rank > len(values) - 1:
            return math.inf
        return float(np.percentile(values, 100.0 * rank / max(len(values) - 1, 1)))
    return float(np.percentile(values, q))


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    if len(values) == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    idx = int(np.searchsorted(cum, q / 100.0 * cum[-1], side="left"))
    return float(values[order][min(idx, len(values) - 1)])


class Observer(SimState):
    """Timeline samples during the run and the :class:`SimResult` at its end."""

    def _sample(self) -> None:
        row: dict[str, float] = {"time_s": self.now}
        for role, pods in self.pools.items():
            row[f"{role}_replicas"] = float(len(pods))
            row[f"{role}_starting"] = float(self.starting[role])
            row[f"{role}_waiting"] = float(sum(len(p.waiting) for p in pods))
            row[f"{role}_running"] = float(sum(p.num_running for p in pods))
            row[f"{role}_kv_usage"] = sum(p.kv_used / p.capacity for p in pods) / max(len(pods), 1)
        if self.central:
            row["router_waiting"] = float(len(self.central))
        self.timeline.append(row)

    def _result(self, *, num_events: int, wall_seconds: float) -> SimResult:
        end = max(self.now, 1e-9)
        pools: dict[str, PoolStats] = {}
        for role in self.pools:
            pods = [p for p in self.all_pods if p.role == role]
            busy = sum(p.busy_seconds for p in pods)
            dec = sum(p.dec_seq_seconds for p in pods)
            replicas = len(self.pools[role])
            pools[role] = PoolStats(
                role=role,
                replicas=replicas,
                busy_fraction=busy / (end * max(len(pods), 1)),
                mean_decode_batch=dec / (end * max(len(pods), 1)),
                batch_occupancy=dec / max(busy, 1e-12) / self.engine.max_num_seqs,
                mean_kv_usage=sum(p.kv_seconds / p.capacity for p in pods) / (end * max(len(pods), 1)),
                prefill_tokens_computed=self.prefill_computed[role],
                prefill_tokens_cached=self.prefill_cached[role],
                preemptions=self.preemptions[role],
                decode_tokens=sum(p.decode_tokens for p in pods),
            )
        measured_requests = [r for r in self.requests if r.arrival_seconds >= self.measure_from]
        last = self.requests[-1].arrival_seconds if self.requests else 0.0
        span = max(last - self.measure_from, 1e-9)
        return SimResult(
            num_measured=len(measured_requests),
            num_unfinished=len(measured_requests) - self.num_measured,
            ttft_seconds=np.asarray(self.ttft),
            prefill_side_seconds=np.asarray(self.ttft_prefill),
            tpot_seconds=np.asarray(self.tpot),
            arrival_seconds=np.asarray(self.arrivals),
            e2e_seconds=np.asarray(self.e2e),
            queue_seconds=np.asarray(self.queue),
            itl_values_seconds=np.asarray(self.itl_values),
            itl_weights=np.asarray(self.itl_weights, dtype=float),
            measured_seconds=span,
            num_gpus=self.fleet.num_gpus,
            pools=pools,
            timeline=self.timeline,
            num_events=num_events,
            wall_seconds=wall_seconds,
            sim_seconds=self.now,
            output_tokens=self.output_tokens,
        )
