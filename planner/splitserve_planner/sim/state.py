"""Event kinds, the job and pod records, and the state every part of the simulator shares.

Events are a heapq of ``(time, seq, kind, payload)``; ``seq`` breaks ties in push order, so
runs are deterministic. :class:`SimState` holds the clock, the event queue, the pools and the
measurements; the router, engine, scaling and results mixins work on it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ..perf_model import StepCost
from ..speculation import NO_SPECULATION
from ..workload import Request
from .config import DISAGGREGATED, EngineSettings, FleetConfig, SimOptions

ARRIVAL, STEP_END, TRANSFER_DONE, SAMPLE, SCALE, POD_READY = range(6)
MAX_MACRO_STEPS = 512


class Job:
    """One request in flight: prompt/prefill progress, decode bookkeeping, timestamps."""

    __slots__ = (
        "req",
        "num_tokens",
        "num_computed",
        "num_cached",
        "remaining",
        "first_token_s",
        "finish_s",
        "kv_ready",
        "join_step",
        "join_ctx",
        "epoch",
        "start_s",
        "pod",
        "prefill_done_s",
        "overflow_tokens",
    )

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
        self.pod: Pod | None = None
        self.prefill_done_s = -1.0
        self.overflow_tokens = 0
        """Prompt tokens this request holds of its decode pod's overflow share (routed there
        because the prefill pool was full) until it finishes; 0 otherwise."""


class StepCounters:
    """Cumulative engine-step counters of one pod, as ``splitserve_engine_*_total``
    (:class:`splitserve_operator.autoscaler.slo.inputs.StepSample` is a window's delta)."""

    __slots__ = (
        "steps",
        "seconds",
        "prefill_tokens",
        "prefill_attention_pairs",
        "decode_rows",
        "decode_context_tokens",
        "decode_only_steps",
        "decode_only_seconds",
        "decode_only_rows",
        "decode_only_context_tokens",
    )

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.prefill_tokens = 0
        self.prefill_attention_pairs = 0
        self.decode_rows = 0
        self.decode_context_tokens = 0
        self.decode_only_steps = 0
        """The decode-only part (``splitserve_engine_decode_only_*_total``): steps without a prefill chunk."""
        self.decode_only_seconds = 0.0
        self.decode_only_rows = 0
        self.decode_only_context_tokens = 0

    def snapshot(self) -> tuple[float, ...]:
        """The six totals, then the four decode-only parts."""
        return (
            float(self.steps),
            self.seconds,
            float(self.prefill_tokens),
            float(self.prefill_attention_pairs),
            float(self.decode_rows),
            float(self.decode_context_tokens),
            float(self.decode_only_steps),
            self.decode_only_seconds,
            float(self.decode_only_rows),
            float(self.decode_only_context_tokens),
        )


class Pod:
    """One engine: its queues, KV usage, decode aggregates and the step it is running."""

    __slots__ = (
        "index",
        "role",
        "perf",
        "engine",
        "capacity",
        "waiting",
        "prefilling",
        "prefill_kv",
        "n_dec",
        "dec_offset",
        "step_index",
        "finish_heap",
        "dec_stack",
        "busy",
        "step_start_s",
        "busy_seconds",
        "dec_seq_seconds",
        "kv_seconds",
        "lru",
        "accepting",
        "inbound",
        "batch_open",
        "cur_prefill",
        "cur_dt",
        "counter",
        "exp_job",
        "macro_k",
        "step_end_s",
        "decode_tokens",
        "macro_dt0",
        "macro_delta",
        "speculation",
        "cur_tokens_per_forward",
        "cur_prefill_tokens",
        "cur_prefill_pairs",
        "cur_decode_rows",
        "cur_decode_context",
        "counters",
        "born_s",
        "gone_s",
        "overflow_tokens",
    )

    def __init__(self, *, index: int, role: str, perf: StepCost, engine: EngineSettings) -> None:
        self.index = index
        self.role = role
        self.perf = perf
        self.engine = engine
        self.capacity = perf.kv_capacity_tokens
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.prefill_kv = 0
        self.n_dec = 0
        self.dec_offset = 0
        self.step_index = 0
        self.finish_heap: list[tuple[int, int, Job, int]] = []
        self.dec_stack: list[tuple[Job, int]] = []
        self.busy = False
        self.step_start_s = 0.0
        self.busy_seconds = 0.0
        self.dec_seq_seconds = 0.0
        self.kv_seconds = 0.0
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.accepting = True
        self.inbound = 0
        self.batch_open = True
        self.cur_prefill: list[tuple[Job, int]] = []
        self.cur_dt = 0.0
        self.counter = 0
        self.exp_job: Job | None = None
        self.macro_k = 1
        self.step_end_s = -1.0
        self.decode_tokens = 0
        self.macro_dt0 = 0.0
        self.macro_delta = 0.0
        self.speculation = NO_SPECULATION if role == "prefill" else engine.speculation
        """Prefill pods never speculate (``spec.scheduling.speculative`` applies to decode and aggregated pods)."""
        self.cur_tokens_per_forward = 1.0
        """Expected tokens per sequence per forward of the running step (> 1: it speculated)."""
        self.cur_prefill_tokens = 0
        """Prompt tokens the running step computes (its prefill chunks)."""
        self.cur_prefill_pairs = 0
        """Causal attention pairs of the running step's prefill chunks."""
        self.cur_decode_rows = 0
        """Decoding sequences in each step of the running event."""
        self.cur_decode_context = 0
        """Their context tokens in the event's first step (it grows by the rows each step)."""
        self.counters = StepCounters()
        """The engine-step counters the runtime exports (:mod:`.observe` reads them)."""
        self.born_s = 0.0
        """When the pod was created (its GPU is held from then: starting pods count)."""
        self.gone_s = -1.0
        self.overflow_tokens = 0
        """Prompt tokens of the overflow requests in flight here (as the router counts them)."""
        """When a removed pod finished draining and gave its GPU back (-1: still here)."""

    @property
    def kv_used(self) -> int:
        return self.prefill_kv + self.n_dec * self.step_index + self.dec_offset

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + self.n_dec

    def is_idle(self) -> bool:
        return not self.busy and not self.waiting and not self.prefilling and self.n_dec == 0


NO_CHUNKS: list[tuple[Job, int]] = []
"""The empty chunk list of a pure decode step (shared, never mutated)."""


class SimState:
    """Clock, events, pools and measurements of one run; the mixins add the behaviour.

    The four hooks at the end are implemented by :class:`~.engine.EngineModel` and
    :class:`~.router.Router`; they are declared here so each mixin can call the other's."""

    def __init__(
        self,
        *,
        fleet: FleetConfig,
        perf: StepCost,
        requests: list[Request],
        options: SimOptions,
        decode_perf: StepCost | None = None,
    ) -> None:
        self.fleet = fleet
        self.perf = perf
        self.decode_perf = decode_perf or perf
        self.requests = requests
        self.last_arrival = requests[-1].arrival_seconds if requests else 0.0
        self.options = options
        self.engine = fleet.engine
        self.macro_steps = options.macro_steps
        self.rng = np.random.default_rng([options.seed, 7])
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.pools: dict[str, list[Pod]] = {}
        self.all_pods: list[Pod] = []
        roles: list[tuple[str, int]]
        if fleet.mode == DISAGGREGATED:
            self.entry_role, roles = "prefill", [("prefill", fleet.prefill_replicas), ("decode", fleet.decode_replicas)]
        else:
            self.entry_role, roles = "aggregated", [("aggregated", fleet.aggregated_replicas)]
        for role, count in roles:
            self.pools[role] = [self._new_pod(role) for _ in range(count)]
        self.rr = 0
        self.central: deque[Job] = deque()
        self.overflowed = 0
        """Requests routed to a decode pod because every prefill pod was full (``prefill_overflow_tokens``)."""
        self.ttft: list[float] = []
        self.ttft_prefill: list[float] = []
        self.tpot: list[float] = []
        self.arrivals: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.itl_values: list[float] = []
        self.itl_weights: list[float] = []
        self.timeline: list[dict[str, float]] = []
        self.measure_from = options.warmup_seconds
        self.num_measured = 0
        self.output_tokens = 0
        self.prefill_computed: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.prefill_cached: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.preemptions: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.starting: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.observing = False
        """Whether the window lists below are kept (SLO mode: :mod:`.observe` drains them each tick)."""
        self.window_ttft: list[float] = []
        """TTFT of every first token since the last autoscaler tick (:mod:`.observe`)."""
        self.window_itl: list[tuple[float, float]] = []
        """(inter-token seconds, tokens) of every decode event since the last tick."""
        self.window_arrivals: list[Request] = []
        """Requests that arrived since the last tick."""

    # ------------------------------------------------------------------ plumbing
    def _new_pod(self, role: str) -> Pod:
        perf = self.decode_perf if role == "decode" else self.perf
        pod = Pod(index=len(self.all_pods), role=role, perf=perf, engine=self.engine)
        pod.born_s = self.now
        self.all_pods.append(pod)
        return pod

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    # ------------------------------------------------------------------ hooks (see the mixins)
    def _start_step(self, pod: Pod) -> None:
        raise NotImplementedError

    def _truncate_macro_step(self, pod: Pod) -> None:
        raise NotImplementedError

    def _pull_central(self, pod: Pod) -> None:
        raise NotImplementedError

    def _choose_decode(self, pods: list[Pod] | None = None) -> Pod:
        raise NotImplementedError
