"""Prometheus metric names: the runtime exports them, the autoscaler and dashboards read them.

Every runtime series carries the labels ``role`` and ``model``; Prometheus adds ``namespace``,
``pod`` and ``inferenceservice`` from pod labels (``docs/architecture.md``, "Metrics").
"""

from __future__ import annotations

from typing import Final


class Metric:
    """Metric names exported by the runtime and the router."""

    REQUESTS_WAITING: Final = "splitserve_requests_waiting"
    REQUESTS_RUNNING: Final = "splitserve_requests_running"
    PROMPT_TOKENS_WAITING: Final = "splitserve_prompt_tokens_waiting"
    KV_CACHE_USAGE_RATIO: Final = "splitserve_kv_cache_usage_ratio"
    KV_CACHE_BLOCKS: Final = "splitserve_kv_cache_blocks"  # a gauge: no _total suffix
    PROMPT_TOKENS_TOTAL: Final = "splitserve_prompt_tokens_total"
    GENERATION_TOKENS_TOTAL: Final = "splitserve_generation_tokens_total"
    PREFIX_CACHE_QUERIED_TOKENS_TOTAL: Final = "splitserve_prefix_cache_queried_tokens_total"
    PREFIX_CACHE_HIT_TOKENS_TOTAL: Final = "splitserve_prefix_cache_hit_tokens_total"
    PREEMPTIONS_TOTAL: Final = "splitserve_preemptions_total"
    SPEC_DECODE_PROPOSED_TOKENS_TOTAL: Final = "splitserve_spec_decode_proposed_tokens_total"
    SPEC_DECODE_ACCEPTED_TOKENS_TOTAL: Final = "splitserve_spec_decode_accepted_tokens_total"
    SPEC_DECODE_ACCEPTED_TOKENS_BY_POSITION_TOTAL: Final = (
        "splitserve_spec_decode_accepted_tokens_by_position_total"  # label: position ("0".."k-1")
    )
    SPEC_DECODE_PROPOSED_TOKENS_BY_POSITION_TOTAL: Final = (
        "splitserve_spec_decode_proposed_tokens_by_position_total"  # label: position ("0".."k-1")
    )
    REQUESTS_TOTAL: Final = "splitserve_requests_total"  # label: outcome
    KV_TRANSFER_BYTES_TOTAL: Final = "splitserve_kv_transfer_bytes_total"
    KV_TRANSFER_FAILURES_TOTAL: Final = "splitserve_kv_transfer_failures_total"
    TIME_TO_FIRST_TOKEN_SECONDS: Final = "splitserve_time_to_first_token_seconds"
    INTER_TOKEN_LATENCY_SECONDS: Final = "splitserve_inter_token_latency_seconds"
    E2E_REQUEST_LATENCY_SECONDS: Final = "splitserve_e2e_request_latency_seconds"
    KV_TRANSFER_SECONDS: Final = "splitserve_kv_transfer_seconds"
    # Engine-step counters: their increases over a window are one exact regression point of the
    # SLO autoscaler's step model (splitserve_operator.autoscaler.slo.inputs.StepSample).
    ENGINE_STEPS_TOTAL: Final = "splitserve_engine_steps_total"
    ENGINE_STEP_SECONDS_TOTAL: Final = "splitserve_engine_step_seconds_total"  # busy time inside steps
    ENGINE_PREFILL_TOKENS_TOTAL: Final = "splitserve_engine_prefill_tokens_total"  # uncached prompt tokens computed
    ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL: Final = "splitserve_engine_prefill_attention_pairs_total"
    ENGINE_DECODE_ROWS_TOTAL: Final = "splitserve_engine_decode_rows_total"  # decoding sequences summed over steps
    ENGINE_DECODE_CONTEXT_TOKENS_TOTAL: Final = "splitserve_engine_decode_context_tokens_total"
    # The decode-only part of the four that apply (steps that computed no prefill chunk): a
    # window's decode-only part and the rest are two regression points with different mixes.
    ENGINE_DECODE_ONLY_STEPS_TOTAL: Final = "splitserve_engine_decode_only_steps_total"
    ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL: Final = "splitserve_engine_decode_only_step_seconds_total"
    ENGINE_DECODE_ONLY_ROWS_TOTAL: Final = "splitserve_engine_decode_only_rows_total"
    ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL: Final = "splitserve_engine_decode_only_context_tokens_total"


class ModelServerMetric:
    """The model-server protocol's gauges, under vLLM's names, which Gateway API Inference
    Extension endpoint pickers (and llm-d's) read. The runtime exports them beside its own
    names, labelled ``model_name``. A stock EPP v1.2.0 reads the queue and the cache info under
    these names by default but KV usage as the older ``vllm:gpu_cache_usage_perc``, so the
    operator's picker Deployment names :data:`KV_CACHE_USAGE_PERC` with
    ``--kv-cache-usage-percentage-metric``."""

    NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
    NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
    KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"  # a fraction 0..1, as vLLM's despite the name
    CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"  # 1, labels block_size and num_gpu_blocks


class OperatorMetric:
    """Metric names exported by the operator."""

    RECONCILE_SECONDS: Final = "splitserve_operator_reconcile_seconds"
    RECONCILE_ERRORS_TOTAL: Final = "splitserve_operator_reconcile_errors_total"
    LEADER: Final = "splitserve_operator_leader"  # 1 while this replica holds the leader Lease
    API_REQUESTS_TOTAL: Final = "splitserve_operator_api_requests_total"
    """Requests the operator's reconciler, autoscaler and leader election sent to the API server
    (labels verb, resource); kopf's own watches and annotation patches are not counted."""
    INFERENCESERVICE_CONDITION: Final = "splitserve_inferenceservice_condition"
    """1 per (namespace, inferenceservice, type, status, reason) an InferenceService's status shows now."""
    AUTOSCALER_DESIRED_REPLICAS: Final = "splitserve_autoscaler_desired_replicas"  # label: role
    AUTOSCALER_READY_REPLICAS: Final = "splitserve_autoscaler_ready_replicas"  # label: role
    AUTOSCALER_DECISIONS_TOTAL: Final = "splitserve_autoscaler_decisions_total"  # role, direction


OUTCOMES: Final = ("success", "aborted", "rejected", "error")
"""Request outcomes for ``Metric.REQUESTS_TOTAL{outcome=...}``."""
