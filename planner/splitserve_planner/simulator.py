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
  removed pods stop taking requests and leave when drained.

Deterministic: every random draw comes from generators seeded by ``seed``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve_contract import defaults

from .perf_model import StepCost, prefill_attention_pairs
from .workload import Request

DISAGGREGATED = "disaggregated"
AGGREGATED = "aggregated"
ROUTER_POLICIES = ("prefix-affinity", "least-load", "round-robin", "central-queue")
PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS = 4.0
"""As :class:`splitserve_runtime.router.policy.PrefillSelector`: a queued request ~ 4 blocks."""

_ARRIVAL, _STEP_END, _TRANSFER_DONE, _SAMPLE, _SCALE, _POD_READY = range(6)
_NO_CHUNKS: list[tuple[_Job, int]] = []
MAX_MACRO_STEPS = 512


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Per-pod engine settings (as ``spec.engine`` and ``spec.kvCache``)."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True
    prefix_caching: bool = True
    block_size: int = defaults.BLOCK_SIZE
    batching: str = "continuous"
    prefix_cache_groups: int = 64
    """LRU capacity of a pod's prefix cache, in prefix groups."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_batched_tokens >= max_num_seqs")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be continuous or static, got {self.batching!r}")
        if self.block_size < 1 or self.prefix_cache_groups < 0:
            raise ValueError("block_size must be >= 1 and prefix_cache_groups >= 0")


@dataclass(frozen=True, kw_only=True)
class AutoscaleSettings:
    """Targets and limits for the simulated autoscaler (as ``spec.autoscaling``)."""

    interval_seconds: float = 15.0
    startup_seconds: float = 60.0
    prefill_target_queue_depth: float = 4.0
    decode_target_kv_utilization: float = 0.8
    decode_target_queue_depth: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 64
    scale_down_stabilization_seconds: float = 300.0


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """The fleet to simulate. Aggregated mode uses ``aggregated_replicas`` only."""

    mode: str
    prefill_replicas: int = 0
    decode_replicas: int = 0
    aggregated_replicas: int = 0
    gpus_per_replica: int = 1
    engine: EngineSettings = EngineSettings()
    router_policy: str = "prefix-affinity"
    kv_link_bytes_per_second: float = 50e9
    kv_transfer_latency_seconds: float = 0.0005
    exponential_service_rate: float | None = None
    autoscale: AutoscaleSettings | None = None

    def __post_init__(self) -> None:
        if self.mode == DISAGGREGATED:
            if self.prefill_replicas < 1 or self.decode_replicas < 1 or self.aggregated_replicas:
                raise ValueError("disaggregated mode needs prefill and decode replicas >= 1 and no aggregated ones")
        elif self.mode == AGGREGATED:
            if self.aggregated_replicas < 1 or self.prefill_replicas or self.decode_replicas:
                raise ValueError("aggregated mode needs aggregated replicas >= 1 and no prefill/decode ones")
        else:
            raise ValueError(f"mode must be {DISAGGREGATED} or {AGGREGATED}, got {self.mode!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {self.router_policy!r}; choose one of: {', '.join(ROUTER_POLICIES)}")
        if self.kv_link_bytes_per_second <= 0 or self.gpus_per_replica < 1:
            raise ValueError("KV link bandwidth must be > 0 and gpus per replica >= 1")

    @property
    def num_gpus(self) -> int:
        return (self.prefill_replicas + self.decode_replicas + self.aggregated_replicas) * self.gpus_per_replica


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    warmup_seconds: float = 0.0
    """Requests arriving before this are simulated but not measured."""
    drain_limit_seconds: float | None = None
    """Stop this long after the last arrival (None: 2 × the arrival span + 60 s); requests
    still unfinished count as missing every SLO."""
    sample_interval_seconds: float = 1.0
    seed: int = 0
    macro_steps: bool = True
    """Run runs of identical-batch decode steps as one event (exact up to the ITL of each step
    being the run's mean); False: one event per step."""


class _Job:
    __slots__ = ("req", "num_tokens", "num_computed", "num_cached", "remaining", "first_token_s",
                 "finish_s", "kv_ready", "join_step", "join_ctx", "epoch", "start_s", "pod",
                 "prefill_done_s")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.num_tokens = req.num_prompt_tokens
        self.num_computed = 0
        self.num_cached = 0
        self.remaining = req.num_output_tokens
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.kv_ready = False
        self.join_step = 0
        self.join_ctx = 0
        self.epoch = 0
        self.start_s = -1.0
        self.pod: _Pod | None = None
        self.prefill_done_s = -1.0


class _Pod:
    __slots__ = ("index", "role", "perf", "engine", "capacity", "waiting", "prefilling", "prefill_kv",
                 "n_dec", "dec_offset", "step_index", "finish_heap", "dec_stack", "busy",
                 "step_start_s", "busy_seconds", "dec_seq_seconds", "kv_seconds", "lru",
                 "accepting", "inbound", "batch_open", "cur_prefill", "cur_dt", "counter",
                 "exp_job", "macro_k", "step_end_s", "decode_tokens", "macro_dt0", "macro_delta")

    def __init__(self, *, index: int, role: str, perf: StepCost, engine: EngineSettings) -> None:
        self.index = index
        self.role = role
        self.perf = perf
        self.engine = engine
        self.capacity = perf.kv_capacity_tokens
        self.waiting: deque[_Job] = deque()
        self.prefilling: list[_Job] = []
        self.prefill_kv = 0
        self.n_dec = 0
        self.dec_offset = 0
        self.step_index = 0
        self.finish_heap: list[tuple[int, int, _Job, int]] = []
        self.dec_stack: list[tuple[_Job, int]] = []
        self.busy = False
        self.step_start_s = 0.0
        self.busy_seconds = 0.0
        self.dec_seq_seconds = 0.0
        self.kv_seconds = 0.0
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.accepting = True
        self.inbound = 0
        self.batch_open = True
        self.cur_prefill: list[tuple[_Job, int]] = []
        self.cur_dt = 0.0
        self.counter = 0
        self.exp_job: _Job | None = None
        self.macro_k = 1
        self.step_end_s = -1.0
        self.decode_tokens = 0
        self.macro_dt0 = 0.0
        self.macro_delta = 0.0

    @property
    def kv_used(self) -> int:
        return self.prefill_kv + self.n_dec * self.step_index + self.dec_offset

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + self.n_dec

    def is_idle(self) -> bool:
        return not self.busy and not self.waiting and not self.prefilling and self.n_dec == 0


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


class Simulator:
    """One run over a request list. Use :func:`simulate`."""

    def __init__(self, *, fleet: FleetConfig, perf: StepCost, requests: list[Request],
                 options: SimOptions, decode_perf: StepCost | None = None) -> None:
        self.fleet = fleet
        self.perf = perf
        self.decode_perf = decode_perf or perf
        self.requests = requests
        self.options = options
        self.engine = fleet.engine
        self.macro_steps = options.macro_steps
        self.rng = np.random.default_rng([options.seed, 7])
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.pools: dict[str, list[_Pod]] = {}
        self.all_pods: list[_Pod] = []
        roles: list[tuple[str, int]]
        if fleet.mode == DISAGGREGATED:
            self.entry_role, roles = "prefill", [("prefill", fleet.prefill_replicas), ("decode", fleet.decode_replicas)]
        else:
            self.entry_role, roles = "aggregated", [("aggregated", fleet.aggregated_replicas)]
        for role, count in roles:
            self.pools[role] = [self._new_pod(role) for _ in range(count)]
        self.rr = 0
        self.central: deque[_Job] = deque()
        self.ttft: list[float] = []
        self.ttft_prefill: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.itl_values: list[float] = []
        self.itl_weights: list[int] = []
        self.timeline: list[dict[str, float]] = []
        self.measure_from = options.warmup_seconds
        self.num_measured = 0
        self.output_tokens = 0
        self.prefill_computed: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.prefill_cached: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.preemptions: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.starting: dict[str, int] = dict.fromkeys(self.pools, 0)

    # ------------------------------------------------------------------ plumbing
    def _new_pod(self, role: str) -> _Pod:
        perf = self.decode_perf if role == "decode" else self.perf
        pod = _Pod(index=len(self.all_pods), role=role, perf=perf, engine=self.engine)
        self.all_pods.append(pod)
        return pod

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        started = time.perf_counter()
        reqs = self.requests
        last_arrival = reqs[-1].arrival_seconds if reqs else 0.0
        drain = self.options.drain_limit_seconds
        stop_at = last_arrival + (2 * last_arrival + 60.0 if drain is None else drain)
        if reqs:
            self._push(reqs[0].arrival_seconds, _ARRIVAL, 0)
        if self.options.sample_interval_seconds > 0:
            self._push(0.0, _SAMPLE, None)
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
            if kind == _STEP_END:
                if at == payload.step_end_s:
                    self._step_end(payload)
                else:
                    num_events -= 1  # superseded by a truncated macro step
            elif kind == _ARRIVAL:
                index: int = payload
                self._arrive(reqs[index])
                if index + 1 < len(reqs):
                    self._push(reqs[index + 1].arrival_seconds, _ARRIVAL, index + 1)
            elif kind == _TRANSFER_DONE:
                job, pod = payload
                pod.inbound -= 1
                pod.waiting.append(job)
                if not pod.busy:
                    self._start_step(pod)
                elif pod.macro_k > 1:
                    self._truncate_macro_step(pod)
            elif kind == _SAMPLE:
                self._sample()
                if events:
                    self._push(at + self.options.sample_interval_seconds, _SAMPLE, None)
            elif kind == _SCALE:
                self._autoscale()
                if at < last_arrival and self.fleet.autoscale is not None:
                    self._push(at + self.fleet.autoscale.interval_seconds, _SCALE, None)
            elif kind == _POD_READY:
                pod = payload
                self.starting[pod.role] -= 1
                self.pools[pod.role].append(pod)
                if self.central:
                    self._pull_central(pod)
        return self._result(num_events=num_events, wall_seconds=time.perf_counter() - started)

    # ------------------------------------------------------------------ routing
    def _arrive(self, req: Request) -> None:
        job = _Job(req)
        if self.fleet.router_policy == "central-queue":
            for pod in self.pools[self.entry_role]:
                if pod.accepting and pod.is_idle():
                    self._enqueue(pod, job)
                    return
            self.central.append(job)
            return
        self._enqueue(self._choose_entry(job), job)

    def _enqueue(self, pod: _Pod, job: _Job) -> None:
        job.pod = pod
        pod.waiting.append(job)
        if not pod.busy:
            self._start_step(pod)
        elif pod.macro_k > 1:
            self._truncate_macro_step(pod)

    def _pull_central(self, pod: _Pod) -> None:
        if self.central and pod.accepting and not pod.waiting and pod.role == self.entry_role:
            self._enqueue(pod, self.central.popleft())

    def _load(self, pod: _Pod) -> int:
        if pod.role == "aggregated":
            return len(pod.waiting) + len(pod.prefilling) + pod.n_dec
        return len(pod.waiting) + len(pod.prefilling)

    def _choose_entry(self, job: _Job) -> _Pod:
        pods = [p for p in self.pools[self.entry_role] if p.accepting]
        policy = self.fleet.router_policy
        if policy == "round-robin":
            self.rr += 1
            return pods[self.rr % len(pods)]
        group = job.req.prefix_group
        if policy == "least-load" or group < 0:
            return min(pods, key=lambda p: (self._load(p), p.num_running, p.index))
        blocks = job.req.num_prefix_tokens // self.engine.block_size

        def score(p: _Pod) -> tuple[float, int]:
            matched = blocks if group in p.lru else 0
            return matched - PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS * self._load(p), hash((p.index, group))

        return max(pods, key=score)

    def _choose_decode(self) -> _Pod:
        pods = [p for p in self.pools["decode"] if p.accepting]
        return min(pods, key=lambda p: (p.kv_used / p.capacity + 0.1 * (len(p.waiting) + p.inbound),
                                        p.n_dec, p.index))

    # ------------------------------------------------------------------ engine steps
    def _start_step(self, pod: _Pod) -> None:
        if self.fleet.exponential_service_rate is not None:
            self._start_exponential(pod)
            return
        if not pod.waiting and not pod.prefilling:  # fast path: a pure decode step
            n = pod.n_dec
            if n == 0:
                pod.busy = False
                return
            ctx = n * pod.step_index + pod.dec_offset
            if pod.prefill_kv + ctx + n <= pod.capacity:
                dt = pod.perf.step_seconds(num_tokens=n, num_seqs=n, num_attention_pairs=ctx + n,
                                           num_kv_tokens=ctx)
                k = 1
                pod.macro_dt0 = dt
                if self.macro_steps and pod.finish_heap:
                    k = min(pod.finish_heap[0][0] - pod.step_index, (pod.capacity - pod.prefill_kv - ctx) // n,
                            MAX_MACRO_STEPS)
                    if k > 1:  # k identical-batch steps in one event; context grows n per step
                        last = ctx + (k - 1) * n
                        last_dt = pod.perf.step_seconds(num_tokens=n, num_seqs=n, num_attention_pairs=last + n,
                                                        num_kv_tokens=last)
                        pod.macro_delta = (last_dt - dt) / (k - 1)
                        dt = k * (dt + last_dt) / 2
                    else:
                        k = 1
                pod.busy = True
                pod.step_start_s = self.now
                pod.cur_prefill = _NO_CHUNKS
                pod.cur_dt = dt
                pod.macro_k = k
                pod.step_end_s = self.now + dt
                self.seq += 1
                heapq.heappush(self.events, (pod.step_end_s, self.seq, _STEP_END, pod))
                return
        engine = pod.engine
        budget = engine.max_batched_tokens
        n_tokens = 0
        n_seqs = 0
        pairs = 0
        kv_tokens = 0
        preempted = False
        # 1. decodes: every decoding sequence needs one more KV slot
        while pod.n_dec and pod.kv_used + pod.n_dec > pod.capacity:
            if not self._preempt_newest(pod):
                break
            preempted = True
        n = pod.n_dec
        if n:
            ctx = n * pod.step_index + pod.dec_offset
            n_tokens += n
            n_seqs += n
            pairs += ctx + n
            kv_tokens += ctx
            budget -= n
        # 2. continuing prefill chunks, oldest first
        chunks: list[tuple[_Job, int]] = []
        for job in pod.prefilling:
            if budget <= 0:
                break
            take = min(job.num_tokens - job.num_computed, budget)
            if not engine.chunked_prefill and take < job.num_tokens - job.num_computed:
                continue
            if pod.kv_used + take > pod.capacity:
                break
            chunks.append((job, take))
            pairs += prefill_attention_pairs(num_new_tokens=take, num_computed_tokens=job.num_computed)
            kv_tokens += job.num_computed
            n_tokens += take
            pod.prefill_kv += take
            budget -= take
        # 3. admission, FCFS
        static = engine.batching == "static"
        if static and pod.n_dec == 0 and not pod.prefilling:
            pod.batch_open = True
        if not preempted and (not static or pod.batch_open):
            while pod.waiting and (budget > 0 or static) and pod.num_running < engine.max_num_seqs:
                job = pod.waiting[0]
                if job.kv_ready:  # a transferred sequence joins the decode batch at once
                    if pod.kv_used + job.num_tokens + 1 > pod.capacity or budget <= 0:
                        if pod.num_running == 0 and job.num_tokens + 1 > pod.capacity:
                            pod.waiting.popleft()  # can never fit: drop it (counted unfinished)
                            continue
                        break
                    pod.waiting.popleft()
                    self._admit_decoded(pod, job)
                    ctx = job.num_tokens
                    n_tokens += 1
                    n_seqs += 1
                    pairs += ctx + 1
                    kv_tokens += ctx
                    budget -= 1
                    continue
                cached = self._prefix_hit(pod, job)
                take = min(job.num_tokens - cached, max(budget, 0))
                if not engine.chunked_prefill and take < job.num_tokens - cached:
                    break
                if pod.kv_used + cached + take > pod.capacity:
                    if pod.num_running == 0 and cached + take > pod.capacity:
                        pod.waiting.popleft()  # can never fit: drop it (counted unfinished)
                        continue
                    break
                pod.waiting.popleft()
                if job.start_s < 0:
                    job.start_s = self.now
                    self.prefill_cached[pod.role] += cached
                job.num_computed = cached
                job.num_cached = cached
                pod.prefill_kv += cached
                pod.prefilling.append(job)
                if take:
                    chunks.append((job, take))
                    pairs += prefill_attention_pairs(num_new_tokens=take, num_computed_tokens=cached)
                    kv_tokens += cached
                    n_tokens += take
                    pod.prefill_kv += take
                    budget -= take
            if static:
                pod.batch_open = False
        if n_tokens == 0:
            pod.busy = False
            return
        n_seqs += sum(1 for job, take in chunks if job.num_computed + take == job.num_tokens)
        dt = pod.perf.step_seconds(num_tokens=n_tokens, num_seqs=max(n_seqs, 1),
                                   num_attention_pairs=pairs, num_kv_tokens=kv_tokens)
        pod.busy = True
        pod.step_start_s = self.now
        pod.cur_prefill = chunks
        pod.cur_dt = dt
        pod.macro_k = 1
        pod.step_end_s = self.now + dt
        self._push(pod.step_end_s, _STEP_END, pod)

    def _prefix_hit(self, pod: _Pod, job: _Job) -> int:
        req = job.req
        if not pod.engine.prefix_caching or req.prefix_group < 0 or req.prefix_group not in pod.lru:
            return 0
        pod.lru.move_to_end(req.prefix_group)
        block = pod.engine.block_size
        return min((req.num_prefix_tokens // block) * block, ((job.num_tokens - 1) // block) * block)

    def _admit_decoded(self, pod: _Pod, job: _Job) -> None:
        """A transferred sequence (its first token already sampled) starts decoding."""
        job.pod = pod
        if job.first_token_s < 0:
            job.first_token_s = self.now
        if job.start_s < 0:
            job.start_s = self.now
        if job.remaining <= 0:
            self._finish(job)
            return
        self._join_decode(pod, job, ctx=job.num_tokens)

    def _join_decode(self, pod: _Pod, job: _Job, *, ctx: int) -> None:
        job.join_step = pod.step_index
        job.join_ctx = ctx
        pod.n_dec += 1
        pod.dec_offset += ctx - pod.step_index
        pod.counter += 1
        heapq.heappush(pod.finish_heap, (pod.step_index + job.remaining, pod.counter, job, job.epoch))
        pod.dec_stack.append((job, job.epoch))

    def _leave_decode(self, pod: _Pod, job: _Job) -> None:
        pod.n_dec -= 1
        pod.dec_offset -= job.join_ctx - job.join_step
        job.epoch += 1

    def _preempt_newest(self, pod: _Pod) -> bool:
        """Free the newest running sequence's KV and re-queue it for recompute."""
        if pod.prefilling:
            job = pod.prefilling.pop()
            pod.prefill_kv -= job.num_computed
            job.num_computed = 0
        else:
            while pod.dec_stack:
                job, epoch = pod.dec_stack.pop()
                if epoch == job.epoch and job.finish_s < 0:
                    break
            else:
                return False
            generated = pod.step_index - job.join_step  # tokens decoded here since joining
            self._leave_decode(pod, job)
            job.num_tokens = job.join_ctx + generated + 1
            job.remaining -= generated
            job.kv_ready = False
            job.num_computed = 0
        self.preemptions[pod.role] += 1
        pod.waiting.appendleft(job)
        return True

    def _truncate_macro_step(self, pod: _Pod) -> None:
        """New work arrived during a k-step event: end it at the next step boundary instead.

        Step j of the run lasts ``dt0 + j·delta`` (context grows by the batch each step), so
        the first j steps end at ``S(j) = j·dt0 + delta·j(j-1)/2``: find the smallest j with
        ``S(j) >= elapsed``."""
        elapsed = self.now - pod.step_start_s
        dt0, delta = pod.macro_dt0, pod.macro_delta
        if delta > 1e-15:  # solve delta/2 j^2 + (dt0 - delta/2) j - elapsed = 0
            b = dt0 - delta / 2
            done = math.ceil((-b + math.sqrt(b * b + 2 * delta * elapsed)) / delta - 1e-9)
        else:
            done = math.ceil(elapsed / dt0 - 1e-9)
        done = min(pod.macro_k, max(1, done))
        if done == pod.macro_k:
            return
        pod.macro_k = done
        pod.cur_dt = done * dt0 + delta * done * (done - 1) / 2
        pod.step_end_s = pod.step_start_s + pod.cur_dt
        self._push(pod.step_end_s, _STEP_END, pod)

    def _step_end(self, pod: _Pod) -> None:
        dt = pod.cur_dt
        if pod.exp_job is not None:
            pod.busy_seconds += dt
            job, pod.exp_job = pod.exp_job, None
            job.first_token_s = self.now
            self._finish(job)
            if self.central and not pod.waiting:
                self._pull_central(pod)
            self._start_exponential(pod)
            return
        pod.busy_seconds += dt
        n = pod.n_dec
        k = pod.macro_k
        if n:
            pod.dec_seq_seconds += n * dt
            pod.decode_tokens += n * k
            if pod.step_start_s >= self.measure_from:
                self.itl_values.append(dt / k)
                self.itl_weights.append(n * k)
        pod.kv_seconds += (pod.prefill_kv + n * (pod.step_index + k / 2) + pod.dec_offset) * dt
        pod.step_index += k
        heap = pod.finish_heap
        step = pod.step_index
        while heap and heap[0][0] <= step:
            _, _, job, epoch = heapq.heappop(heap)
            if epoch != job.epoch:
                continue
            self._leave_decode(pod, job)
            self._finish(job)
        if pod.cur_prefill:
            for job, take in pod.cur_prefill:
                job.num_computed += take
                self.prefill_computed[pod.role] += take
                if job.num_computed >= job.num_tokens:
                    self._prefill_done(pod, job)
            pod.cur_prefill = _NO_CHUNKS
        if self.central and not pod.waiting:
            self._pull_central(pod)
        self._start_step(pod)

    def _prefill_done(self, pod: _Pod, job: _Job) -> None:
        pod.prefilling.remove(job)
        req = job.req
        if pod.engine.prefix_caching and req.prefix_group >= 0 and pod.engine.prefix_cache_groups:
            pod.lru[req.prefix_group] = None
            pod.lru.move_to_end(req.prefix_group)
            while len(pod.lru) > pod.engine.prefix_cache_groups:
                pod.lru.popitem(last=False)
        job.remaining -= 1  # the step that completed the prompt sampled a token
        if pod.role == "prefill":
            pod.prefill_kv -= job.num_tokens
            job.prefill_done_s = self.now
            job.kv_ready = True
            target = self._choose_decode()
            target.inbound += 1
            seconds = self.fleet.kv_transfer_latency_seconds + job.num_tokens * self.perf.kv_bytes_per_token / self.fleet.kv_link_bytes_per_second
            self._push(self.now + seconds, _TRANSFER_DONE, (job, target))
            return
        pod.prefill_kv -= job.num_tokens
        if job.first_token_s < 0:
            job.first_token_s = self.now
        if job.remaining <= 0:
            self._finish(job)
            return
        self._join_decode(pod, job, ctx=job.num_tokens)

    def _finish(self, job: _Job) -> None:
        job.finish_s = self.now
        req = job.req
        if req.arrival_seconds < self.measure_from:
            return
        self.num_measured += 1
        ttft = job.first_token_s - req.arrival_seconds
        e2e = self.now - req.arrival_seconds
        self.ttft.append(ttft)
        self.ttft_prefill.append(job.prefill_done_s - req.arrival_seconds if job.prefill_done_s >= 0 else ttft)
        self.e2e.append(e2e)
        outputs = req.num_output_tokens
        self.tpot.append((e2e - ttft) / (outputs - 1) if outputs > 1 else 0.0)
        self.queue.append(job.start_s - req.arrival_seconds)
        self.output_tokens += outputs

    # ------------------------------------------------------------------ validation mode
    def _start_exponential(self, pod: _Pod) -> None:
        if not pod.waiting:
            pod.busy = False
            return
        job = pod.waiting.popleft()
        job.start_s = self.now
        dt = float(self.rng.exponential(1.0 / self.fleet.exponential_service_rate))  # type: ignore[operator]
        pod.busy = True
        pod.exp_job = job
        pod.cur_dt = dt
        pod.step_start_s = self.now
        pod.step_end_s = self.now + dt
        self._push(pod.step_end_s, _STEP_END, pod)

    # ------------------------------------------------------------------ observation
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
                role=role, replicas=replicas, busy_fraction=busy / (end * max(len(pods), 1)),
                mean_decode_batch=dec / (end * max(len(pods), 1)),
                batch_occupancy=dec / max(busy, 1e-12) / self.engine.max_num_seqs,
                mean_kv_usage=sum(p.kv_seconds / p.capacity for p in pods) / (end * max(len(pods), 1)),
                prefill_tokens_computed=self.prefill_computed[role],
                prefill_tokens_cached=self.prefill_cached[role], preemptions=self.preemptions[role],
                decode_tokens=sum(p.decode_tokens for p in pods))
        measured_requests = [r for r in self.requests if r.arrival_seconds >= self.measure_from]
        last = self.requests[-1].arrival_seconds if self.requests else 0.0
        span = max(last - self.measure_from, 1e-9)
        return SimResult(
            num_measured=len(measured_requests), num_unfinished=len(measured_requests) - self.num_measured,
            ttft_seconds=np.asarray(self.ttft), prefill_side_seconds=np.asarray(self.ttft_prefill),
            tpot_seconds=np.asarray(self.tpot),
            e2e_seconds=np.asarray(self.e2e), queue_seconds=np.asarray(self.queue),
            itl_values_seconds=np.asarray(self.itl_values), itl_weights=np.asarray(self.itl_weights, dtype=float),
            measured_seconds=span, num_gpus=self.fleet.num_gpus, pools=pools, timeline=self.timeline,
            num_events=num_events, wall_seconds=wall_seconds, sim_seconds=self.now,
            output_tokens=self.output_tokens)

    # ------------------------------------------------------------------ autoscaling
    def _init_autoscaler(self) -> None:
        from .autoscale import SimAutoscaler

        settings = self.fleet.autoscale
        assert settings is not None
        self.scaler = SimAutoscaler(settings=settings, initial_replicas={r: len(p) for r, p in self.pools.items()},
                                    gpus_per_replica=self.fleet.gpus_per_replica)
        self._push(settings.interval_seconds, _SCALE, None)

    def _autoscale(self) -> None:
        from .autoscale import PoolObservation

        settings = self.fleet.autoscale
        assert settings is not None
        observations = {
            role: PoolObservation(
                current_replicas=len(pods) + self.starting[role], ready_replicas=len(pods),
                requests_waiting=float(sum(len(p.waiting) for p in pods)),
                kv_cache_usage_ratio=sum(p.kv_used / p.capacity for p in pods) / max(len(pods), 1))
            for role, pods in self.pools.items()}
        for role, desired in self.scaler.step(now_seconds=self.now, observations=observations).items():
            pods = self.pools[role]
            current = observations[role].current_replicas
            for _ in range(desired - current):
                self.starting[role] += 1
                self._push(self.now + settings.startup_seconds, _POD_READY, self._new_pod(role))
            for _ in range(current - desired):
                if len(pods) <= 1:
                    break
                pods.pop().accepting = False  # newest first, as a ReplicaSet scales down; it drains


def simulate(*, fleet: FleetConfig, perf: StepCost, requests: list[Request],
             options: SimOptions | None = None, decode_perf: StepCost | None = None) -> SimResult:
    """Run the fleet over ``requests`` (sorted by arrival) and return its latencies and usage."""
    return Simulator(fleet=fleet, perf=perf, requests=requests, options=options or SimOptions(),
                     decode_perf=decode_perf).run()
