"""A discrete-event simulator of a serving fleet: router, prefill/decode or aggregated pools.

Events (a heapq of ``(time, seq, kind, payload)``): request arrival, engine step end, KV
transfer done, timeline sample, autoscaler tick, pod ready. Each pod is an engine that runs
one step at a time, scheduled as our runtime's scheduler does it
(:mod:`splitserve_runtime.engine.scheduler`): decodes first, then continuing prefill chunks,
then FCFS admission within the token budget (``max_batched_tokens``) and ``max_num_seqs``,
with a prefix-cache lookup at admission. The step's duration comes from a
:class:`~.perf_model.StepCost` for the step's exact mix of prefill chunks and decodes, so
aggregated serving pays for prefill/decode interference and disaggregated serving does not.

* **Decode is O(1) per step**: a pod keeps its decoding sequences as aggregates (count and
  total context, as ``n·step + Σ(context_at_join − step_at_join)``) and a heap of finish steps;
  that is what makes an hour at 100 req/s take seconds.
* **KV capacity**: a pod holds ``kv_capacity_tokens``; when the next step does not fit, the
  newest running sequence is preempted by recompute (its KV is freed, it re-queues at the front
  with prompt + generated tokens to prefill again). Cached prefixes live in free memory and
  are not counted (as the runtime's ``kv_cache_usage_ratio``).
* **Prefix cache**: an LRU of prefix groups per pod (capacity in groups); a hit skips the
  group's full blocks of prefill. The router's prefix-affinity policy scores pods as the
  router does (matched blocks − 4 × queue) against that same LRU.
* **Disaggregated**: a finished prefill sends the KV (prompt tokens × KV bytes per token)
  over a link of ``kv_link_bytes_per_second`` (no contention modelled) to the decode pod with
  the most KV headroom; the first token reaches the client when the decode pod admits the
  sequence (so TTFT includes prefill queueing, prefill, transfer and decode admission).
* **Static batching** (``batching="static"``, for comparison): a pod admits a batch only when
  it is empty, then runs it to completion.
* **Exponential service** (``exponential_service_rate``, validation only): each request takes
  an exponentially distributed time, one at a time, so pools are M/M/1 or, with the
  ``central-queue`` router, M/M/c.
* **Autoscaling** (optional): every interval the operator's own
  :func:`splitserve_operator.autoscaler.decision.decide` (imported, not copied) sees the
  simulated queue depth and KV usage per pool; new pods serve after a start-up delay,
  removed pods stop taking requests and leave when drained. In SLO mode
  (``AutoscaleSettings.slo``) the operator's SLO controller
  (:mod:`splitserve_operator.autoscaler.slo`) decides instead, fed the engine-step counters,
  latency quantiles and load the operator would read (:mod:`.sim.observe`).

Deterministic: every random draw comes from generators seeded by ``seed``.

The parts live in :mod:`splitserve_planner.sim` (configuration, events and state, router,
engine steps, autoscaling hook, results); this module runs the event loop and exports the
public names.
"""

from __future__ import annotations

import heapq
import time
from typing import Any

from .perf_model import StepCost
from .sim.config import (
    AGGREGATED,
    DISAGGREGATED,
    PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS,
    ROUTER_POLICIES,
    AutoscaleSettings,
    EngineSettings,
    FleetConfig,
    SimOptions,
)
from .sim.engine import EngineModel
from .sim.results import Observer, PoolStats, SimResult
from .sim.router import Router
from .sim.scaling import Scaling
from .sim.state import (
    ARRIVAL,
    MAX_MACRO_STEPS,
    POD_READY,
    SAMPLE,
    SCALE,
    STEP_END,
    TRANSFER_DONE,
    Pod,
)
from .workload import Request

__all__ = [
    "AGGREGATED",
    "DISAGGREGATED",
    "MAX_MACRO_STEPS",
    "PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS",
    "ROUTER_POLICIES",
    "AutoscaleSettings",
    "EngineSettings",
    "FleetConfig",
    "PoolStats",
    "SimOptions",
    "SimResult",
    "Simulator",
    "simulate",
]


class Simulator(Router, EngineModel, Scaling, Observer):
    """One run over a request list. Use :func:`simulate`."""

    def run(self) -> SimResult:
        started = time.perf_counter()
        reqs = self.requests
        drain = self.options.drain_limit_seconds
        stop_at = self.last_arrival + (2 * self.last_arrival + 60.0 if drain is None else drain)
        if reqs:
            self._push(reqs[0].arrival_seconds, ARRIVAL, 0)
        if self.options.sample_interval_seconds > 0:
            self._push(0.0, SAMPLE, None)
        if self.fleet.autoscale is not None:
            self._init_autoscaler()
        num_events = 0
        events = self.events
        while events:
            at, _, kind, payload = heapq.heappop(events)
            if at > stop_at:
                break
            self.now = at
            num_events += 1
            if kind == STEP_END:
                if at == payload.step_end_s:
                    self._step_end(payload)
                else:
                    num_events -= 1  # superseded by a truncated macro step
            else:
                self._dispatch(kind, payload)
        return self._result(num_events=num_events, wall_seconds=time.perf_counter() - started)

    def _dispatch(self, kind: int, payload: Any) -> None:
        """Every event but a step end (the most frequent, handled inline by :meth:`run`)."""
        at = self.now
        if kind == ARRIVAL:
            index: int = payload
            reqs = self.requests
            self._arrive(reqs[index])
            if index + 1 < len(reqs):
                self._push(reqs[index + 1].arrival_seconds, ARRIVAL, index + 1)
        elif kind == TRANSFER_DONE:
            job, pod = payload
            pod.inbound -= 1
            pod.waiting.append(job)
            if not pod.busy:
                self._start_step(pod)
            elif pod.macro_k > 1:
                self._truncate_macro_step(pod)
        elif kind == SAMPLE:
            self._sample()
            if self.events:
                self._push(at + self.options.sample_interval_seconds, SAMPLE, None)
        elif kind == SCALE:
            self._autoscale()
            if at < self.last_arrival and self.fleet.autoscale is not None:
                self._push(at + self.fleet.autoscale.interval_seconds, SCALE, None)
        elif kind == POD_READY:
            self._pod_ready(payload)

    def _pod_ready(self, pod: Pod) -> None:
        self.starting[pod.role] -= 1
        self.pools[pod.role].append(pod)
        if self.central:
            self._pull_central(pod)


def simulate(
    *,
    fleet: FleetConfig,
    perf: StepCost,
    requests: list[Request],
    options: SimOptions | None = None,
    decode_perf: StepCost | None = None,
) -> SimResult:
    """Run the fleet over ``requests`` (sorted by arrival) and return its latencies and usage."""
    return Simulator(
        fleet=fleet, perf=perf, requests=requests, options=options or SimOptions(), decode_perf=decode_perf
    ).run()
