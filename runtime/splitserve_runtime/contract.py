"""The contract between the operator, the runtime, the router and the tests.

Everything that crosses a process boundary is named here exactly once: ports, labels,
metric names, and the command-line flags of `splitserve serve` and `splitserve router`.
The operator renders pod arguments with :func:`serve_argv` / :func:`router_argv`; the
runtime builds its argument parser from the same field tables with :func:`add_serve_arguments`
/ :func:`add_router_arguments`. A flag therefore cannot drift between the two sides.

This module must stay importable without torch (the operator imports it) and must not
import anything from the rest of the runtime.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

# --------------------------------------------------------------------------- ports
HTTP_PORT = 8000
"""OpenAI API, /health, /ready, /metrics on every runtime and router pod."""
KV_TRANSFER_PORT = 8100
"""Prefill -> decode KV block transfer (TCP connector)."""

HTTP_PORT_NAME = "http"
KV_TRANSFER_PORT_NAME = "kv"

# --------------------------------------------------------------------------- labels
API_GROUP = "splitserve.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "splitserve.dev/role"
LABEL_COMPAT_HASH = "splitserve.dev/compat-hash"

LABEL_NAME_VALUE = "splitserve"
MANAGED_BY_VALUE = "splitserve-operator"

ANNOTATION_CONFIG_HASH = "splitserve.dev/config-hash"
ANNOTATION_PAUSED = "splitserve.dev/paused"
ANNOTATION_POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

FIELD_MANAGER_RECONCILER = "splitserve-operator"
FIELD_MANAGER_AUTOSCALER = "splitserve-autoscaler"

# Prometheus scrape discovery: pods carrying this label (value "true") are scraped on
# HTTP_PORT at METRICS_PATH. Prometheus relabels pod labels into `namespace`, `pod`,
# and `inferenceservice` (from LABEL_INSTANCE).
LABEL_SCRAPE = "splitserve.dev/scrape"
METRICS_PATH = "/metrics"

# Runtime endpoints beyond the OpenAI API (router <-> pools).
INFO_PATH = "/v1/splitserve/info"
"""GET: {role, model, compat_hash, kv_endpoint, block_size, max_model_len} of a runtime pod."""
KV_TRANSFER_PARAMS_FIELD = "kv_transfer_params"
"""Extension field of completion/chat requests and responses that carries the P->D handoff:
request to prefill: {"do_remote_decode": true}; prefill's response: {"remote_endpoint",
"remote_request_id", "num_prompt_tokens", "first_token_id", "compat_hash"}; request to decode:
that response object, which makes decode pull the KV instead of computing it."""
HEADER_REQUEST_ID = "x-request-id"

# Environment variables the runtime reads (secrets never go on the command line).
ENV_API_KEY = "SPLITSERVE_API_KEY"
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_IP = "POD_IP"
ENV_MODEL_CACHE = "SPLITSERVE_MODEL_CACHE"
"""Directory that `hf://org/name` URIs resolve in (HF hub cache layout or org/name dirs)."""


class Role(str, enum.Enum):
    """What a runtime process does; also the value of LABEL_ROLE / LABEL_COMPONENT."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class RoutingPolicy(str, enum.Enum):
    PREFIX_AFFINITY = "PrefixAffinity"
    LEAST_LOAD = "LeastLoad"
    ROUND_ROBIN = "RoundRobin"


# --------------------------------------------------------------------------- metrics
class Metric:
    """Metric names exported by the runtime (DESIGN.md section 5). Every series has
    the labels `role` and `model`."""

    REQUESTS_WAITING = "splitserve_requests_waiting"
    REQUESTS_RUNNING = "splitserve_requests_running"
    PROMPT_TOKENS_WAITING = "splitserve_prompt_tokens_waiting"
    KV_CACHE_USAGE_RATIO = "splitserve_kv_cache_usage_ratio"
    KV_CACHE_BLOCKS_TOTAL = "splitserve_kv_cache_blocks_total"
    PROMPT_TOKENS_TOTAL = "splitserve_prompt_tokens_total"
    GENERATION_TOKENS_TOTAL = "splitserve_generation_tokens_total"
    PREFIX_CACHE_QUERIED_TOKENS_TOTAL = "splitserve_prefix_cache_queried_tokens_total"
    PREFIX_CACHE_HIT_TOKENS_TOTAL = "splitserve_prefix_cache_hit_tokens_total"
    PREEMPTIONS_TOTAL = "splitserve_preemptions_total"
    REQUESTS_TOTAL = "splitserve_requests_total"  # label: outcome
    KV_TRANSFER_BYTES_TOTAL = "splitserve_kv_transfer_bytes_total"
    KV_TRANSFER_FAILURES_TOTAL = "splitserve_kv_transfer_failures_total"
    TIME_TO_FIRST_TOKEN_SECONDS = "splitserve_time_to_first_token_seconds"
    INTER_TOKEN_LATENCY_SECONDS = "splitserve_inter_token_latency_seconds"
    E2E_REQUEST_LATENCY_SECONDS = "splitserve_e2e_request_latency_seconds"
    KV_TRANSFER_SECONDS = "splitserve_kv_transfer_seconds"


class OperatorMetric:
    RECONCILE_SECONDS = "splitserve_operator_reconcile_seconds"
    AUTOSCALER_DESIRED_REPLICAS = "splitserve_autoscaler_desired_replicas"  # label: role
    AUTOSCALER_DECISIONS_TOTAL = "splitserve_autoscaler_decisions_total"  # role, direction


# Request outcomes for Metric.REQUESTS_TOTAL{outcome=...}
OUTCOMES = ("success", "aborted", "rejected", "error")


# --------------------------------------------------------------------------- flags
@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: `--<name>` mapped to the dataclass field `dest`."""

    name: str
    dest: str
    help: str
    type: type = str
    choices: tuple[str, ...] | None = None
    is_bool: bool = False  # rendered as --name / --no-name


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """Arguments of `splitserve serve`. Defaults here are the runtime's defaults."""

    model: str = ""
    served_model_name: str = ""
    revision: str = ""
    role: str = Role.AGGREGATED.value
    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    kv_port: int = KV_TRANSFER_PORT
    device: str = "auto"  # auto | cuda | cpu
    attention_backend: str = "auto"  # auto | triton | torch
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    quantization: str = "none"  # none | fp8 | int8 | int4
    max_model_len: int = 0  # 0 = from config.json
    block_size: int = 16
    kv_memory_fraction: float = 0.9
    num_kv_blocks: int = 0  # 0 = measure from free memory at start-up
    prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    max_queue_len: int = 1024
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    drain_timeout_seconds: float = 30.0
    kv_ttl_seconds: float = 30.0  # prefill role: unclaimed KV is freed after this
    seed: int = 0
    compat_hash: str = ""  # set by the operator (LABEL_COMPAT_HASH); reported at INFO_PATH


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("model", "model", "model URI: hf://org/name, file:///path, pvc://claim/path or a local path"),
    Flag("served-model-name", "served_model_name", "name clients use in the `model` field"),
    Flag("revision", "revision", "model revision (hf:// URIs)"),
    Flag("role", "role", "what this process does", choices=tuple(r.value for r in Role if r is not Role.ROUTER)),
    Flag("host", "host", "listen address"),
    Flag("port", "port", "HTTP port", type=int),
    Flag("kv-port", "kv_port", "KV transfer port", type=int),
    Flag("device", "device", "compute device", choices=("auto", "cuda", "cpu")),
    Flag("attention-backend", "attention_backend", "kernel backend", choices=("auto", "triton", "torch")),
    Flag("dtype", "dtype", "weight/activation dtype", choices=("auto", "bfloat16", "float16", "float32")),
    Flag("quantization", "quantization", "weight quantization", choices=("none", "fp8", "int8", "int4")),
    Flag("max-model-len", "max_model_len", "context length limit (0: from the model config)", type=int),
    Flag("block-size", "block_size", "tokens per KV cache block", type=int),
    Flag("kv-memory-fraction", "kv_memory_fraction", "fraction of free device memory for the KV cache", type=float),
    Flag("num-kv-blocks", "num_kv_blocks", "fixed number of KV blocks (0: measure at start-up)", type=int),
    Flag("prefix-caching", "prefix_caching", "reuse KV blocks of identical prompt prefixes", is_bool=True),
    Flag("max-num-seqs", "max_num_seqs", "maximum running sequences per step", type=int),
    Flag("max-num-batched-tokens", "max_num_batched_tokens", "token budget per engine step", type=int),
    Flag("chunked-prefill", "chunked_prefill", "split long prompts across steps", is_bool=True),
    Flag("max-queue-len", "max_queue_len", "waiting requests before answering 429", type=int),
    Flag("tensor-parallel-size", "tensor_parallel_size", "GPUs per tensor-parallel group", type=int),
    Flag("pipeline-parallel-size", "pipeline_parallel_size", "pipeline stages", type=int),
    Flag("drain-timeout-seconds", "drain_timeout_seconds", "grace for in-flight requests on SIGTERM", type=float),
    Flag("kv-ttl-seconds", "kv_ttl_seconds", "prefill role: free unclaimed KV after this", type=float),
    Flag("seed", "seed", "default sampling seed", type=int),
    Flag("compat-hash", "compat_hash", "KV compatibility hash (image + model + KV layout); the router pairs equal hashes"),
)


@dataclasses.dataclass(frozen=True)
class RouterArgs:
    """Arguments of `splitserve router`."""

    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    policy: str = RoutingPolicy.PREFIX_AFFINITY.value
    session_header: str = "x-session-id"
    discovery: str = "static"  # static | kubernetes
    namespace: str = ""
    inference_service: str = ""
    prefill_endpoints: str = ""  # static: comma-separated host:port (HTTP); KV port from /v1/splitserve/info
    decode_endpoints: str = ""
    aggregated_endpoints: str = ""
    model: str = ""  # tokenizer source for prefix hashing (same URI as the pools)
    served_model_name: str = ""
    block_size: int = 16
    short_prompt_threshold: int = 64  # prompts with fewer uncached tokens go straight to decode
    health_interval_seconds: float = 2.0
    request_timeout_seconds: float = 600.0


ROUTER_FLAGS: tuple[Flag, ...] = (
    Flag("host", "host", "listen address"),
    Flag("port", "port", "HTTP port", type=int),
    Flag("policy", "policy", "prefill pod selection", choices=tuple(p.value for p in RoutingPolicy)),
    Flag("session-header", "session_header", "header that pins a chat session to a pod"),
    Flag("discovery", "discovery", "how pods are found", choices=("static", "kubernetes")),
    Flag("namespace", "namespace", "kubernetes discovery: namespace"),
    Flag("inference-service", "inference_service", "kubernetes discovery: InferenceService name"),
    Flag("prefill-endpoints", "prefill_endpoints", "static discovery: host:port,... of prefill pods"),
    Flag("decode-endpoints", "decode_endpoints", "static discovery: host:port,... of decode pods"),
    Flag("aggregated-endpoints", "aggregated_endpoints", "static discovery: host:port,... of aggregated pods"),
    Flag("model", "model", "model URI (tokenizer for prefix hashing)"),
    Flag("served-model-name", "served_model_name", "name clients use in the `model` field"),
    Flag("block-size", "block_size", "tokens per KV block (prefix hash granularity)", type=int),
    Flag("short-prompt-threshold", "short_prompt_threshold", "send prompts shorter than this straight to decode (0: never)", type=int),
    Flag("health-interval-seconds", "health_interval_seconds", "pod health-check period", type=float),
    Flag("request-timeout-seconds", "request_timeout_seconds", "upper bound for one upstream request", type=float),
)


def _add_arguments(parser: argparse.ArgumentParser, flags: Sequence[Flag], defaults: Any) -> None:
    for flag in flags:
        default = getattr(defaults, flag.dest)
        if flag.is_bool:
            parser.add_argument(
                f"--{flag.name}", dest=flag.dest, default=default,
                action=argparse.BooleanOptionalAction, help=flag.help,
            )
        else:
            parser.add_argument(
                f"--{flag.name}", dest=flag.dest, default=default, type=flag.type,
                choices=flag.choices, help=f"{flag.help} (default: {default!r})",
            )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_arguments(parser, SERVE_FLAGS, ServeArgs())


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    _add_arguments(parser, ROUTER_FLAGS, RouterArgs())


def serve_args_from_namespace(ns: argparse.Namespace) -> ServeArgs:
    return ServeArgs(**{f.dest: getattr(ns, f.dest) for f in SERVE_FLAGS})


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    return RouterArgs(**{f.dest: getattr(ns, f.dest) for f in ROUTER_FLAGS})


def _argv(flags: Sequence[Flag], args: Any, defaults: Any) -> list[str]:
    """Render only the flags whose value differs from the default, in table order."""
    out: list[str] = []
    for flag in flags:
        value = getattr(args, flag.dest)
        if value == getattr(defaults, flag.dest):
            continue
        if flag.is_bool:
            out.append(f"--{flag.name}" if value else f"--no-{flag.name}")
        else:
            out.extend([f"--{flag.name}", str(value)])
    return out


def serve_argv(args: ServeArgs) -> list[str]:
    """`splitserve serve` arguments for `args` (the operator puts these in pod specs)."""
    return _argv(SERVE_FLAGS, args, ServeArgs())


def router_argv(args: RouterArgs) -> list[str]:
    return _argv(ROUTER_FLAGS, args, RouterArgs())
