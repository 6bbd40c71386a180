"""What to simulate: per-pod engine settings, the fleet, autoscaling targets, run options."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contract import defaults
from splitserve_operator.autoscaler.slo.inputs import SloTarget

from ..speculation import NO_SPECULATION, Speculation

DISAGGREGATED = "disaggregated"
AGGREGATED = "aggregated"
ROUTER_POLICIES = ("prefix-affinity", "least-load", "round-robin", "central-queue")
PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS = 4.0
"""As :class:`splitserve_runtime.router.policy.PrefillSelector`: a queued request ~ 4 blocks."""


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Per-pod engine settings (as ``spec.scheduling`` and ``spec.kvCache``)."""

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True
    prefix_caching: bool = True
    block_size: int = defaults.BLOCK_SIZE
    batching: str = "continuous"
    prefix_cache_groups: int = 64
    """LRU capacity of a pod's prefix cache, in prefix groups."""
    speculation: Speculation = NO_SPECULATION
    """Speculative decoding of decode and aggregated pods (prefill pods never speculate)."""

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
    slo: SloTarget | None = None
    """Scale on the SLO (:func:`splitserve_operator.autoscaler.slo.controller.decide_slo`) instead
    of the targets above; the startup delay is then measured by the controller, not told."""
    slo_target_floors: bool = False
    """With ``slo``: the targets above are configured too, and what target tracking would choose
    is a floor under the SLO decision (``spec.autoscaling`` with both set)."""
    max_from_seconds: float | None = None
    """From this time on every pool is asked for ``max_replicas`` whatever the policy decides (a
    bound, not a policy: the ``shift-bound`` of ``bench/splitserve_bench/slo_compare.py``)."""


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
    prefill_overflow_tokens: int = 0
    """As the router's ``--prefill-overflow-tokens`` (``spec.router.prefillOverflowTokens``): when
    every prefill pod has this many uncached prompt tokens queued, an arrival prefills on the
    decode pod it would be handed to, if that pod has fewer queued and in overflow requests in
    flight. 0: never."""
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
            raise ValueError(
                f"unknown router policy {self.router_policy!r}; choose one of: {', '.join(ROUTER_POLICIES)}"
            )
        if self.prefill_overflow_tokens < 0:
            raise ValueError("prefill_overflow_tokens must be >= 0")
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
    observation_lag_seconds: float = 0.0
    """The request load an SLO round reads (rate, prompt and output lengths) is that of the
    window ending this long before the round. 0: the window ending at the round, as the tables
    of docs/slo-autoscaling-simulation.md were measured. The operator's view is staler: it reads
    ``rate()`` over Prometheus scrapes (up to a scrape interval old) of counters that count a
    request when it finishes; a lag of one interval puts a number on that (latency quantiles and
    step counters are still read unlagged)."""
