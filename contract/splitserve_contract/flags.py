"""Command-line flags of ``splitserve serve`` and ``splitserve router``, as field tables.

The operator renders pod arguments with :func:`serve_argv` / :func:`router_argv`; the runtime
builds its argument parser from the same tables with :func:`add_serve_arguments` /
:func:`add_router_arguments`. A flag therefore cannot drift between the two sides. Choices of
capability-bound flags come from :mod:`splitserve_contract.capabilities`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from . import capabilities as caps
from . import defaults
from .engines import DEFAULT_ENGINE, Engine
from .wire import HTTP_PORT, KV_TRANSFER_PORT, Role, RoutingPolicy


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
    dtype: str = "auto"
    quantization: str = "none"
    max_model_len: int = 0  # 0 = from config.json
    block_size: int = defaults.BLOCK_SIZE
    kv_memory_fraction: float = defaults.KV_MEMORY_FRACTION
    num_kv_blocks: int = 0  # 0 = measure from free memory at start-up
    kv_cache_dtype: str = "auto"  # auto (= dtype) | fp8 (e4m3, per-tensor scales)
    prefix_caching: bool = True
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True
    cuda_graphs: bool = False  # replay pure-decode steps from CUDA graphs (batch-size buckets)
    max_queue_len: int = defaults.MAX_QUEUE_LEN
    max_request_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES
    header_timeout_seconds: float = defaults.HEADER_TIMEOUT_SECONDS
    body_idle_timeout_seconds: float = defaults.BODY_IDLE_TIMEOUT_SECONDS
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1  # pods holding one replica's ranks (a LeaderWorkerSet group)
    node_rank: int = -1  # this pod's place in the group (-1: $LWS_WORKER_INDEX, else 0)
    leader_address: str = ""  # the group's leader pod ("": $LWS_LEADER_ADDRESS)
    rendezvous_port: int = 29500  # the leader's port where the group's ranks meet
    drain_timeout_seconds: float = defaults.DRAIN_TIMEOUT_SECONDS
    engine_step_timeout_seconds: float = defaults.ENGINE_STEP_TIMEOUT_SECONDS  # 0: no watchdog
    kv_ttl_seconds: float = defaults.KV_TTL_SECONDS  # prefill role: unclaimed KV is freed after this
    seed: int = 0
    speculative_method: str = "none"  # none | ngram (speculative decoding)
    num_speculative_tokens: int = 4
    speculative_max_num_seqs: int = 16  # no speculation in steps with more decoding sequences
    speculative_draft_model: str = ""  # --speculative-method draft: the draft model's URI
    compat_hash: str = ""  # set by the operator (LABEL_COMPAT_HASH); reported at INFO_PATH
    prefill_headers: bool = False  # decode role, behind a Gateway endpoint picker
    prefill_timeout_seconds: float = defaults.PREFILL_TIMEOUT_SECONDS  # decode role: header-named prefill
    handoff_key_file: str = ""  # P/D roles: HMAC key authenticating kv_transfer_params ("" = none)
    rendezvous_key_file: str = ""  # --nnodes > 1: secret authenticating the group's control messages


def _str_choices(capability: caps.Capability) -> tuple[str, ...]:
    return tuple(str(v) for v in capability.known)


_READ_TIMEOUT_FLAGS: tuple[Flag, ...] = (
    Flag(
        "header-timeout-seconds",
        "header_timeout_seconds",
        "time a client has to send a request's line and headers, from its first byte or the "
        "connection's start (then 408 and closed; 0: no bound)",
        type=float,
    ),
    Flag(
        "body-idle-timeout-seconds",
        "body_idle_timeout_seconds",
        "longest pause between the bytes of a request body (then 408 and closed; 0: no bound)",
        type=float,
    ),
)
"""Both HTTP servers' bounds on reading a request (the runtime's ``read_timeouts``)."""


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
    Flag("dtype", "dtype", "weight/activation dtype", choices=_str_choices(caps.DTYPE)),
    Flag("quantization", "quantization", "weight quantization", choices=_str_choices(caps.QUANTIZATION)),
    Flag("max-model-len", "max_model_len", "context length limit (0: from the model config)", type=int),
    Flag("block-size", "block_size", "tokens per KV cache block", type=int),
    Flag("kv-memory-fraction", "kv_memory_fraction", "fraction of free device memory for the KV cache", type=float),
    Flag("num-kv-blocks", "num_kv_blocks", "fixed number of KV blocks (0: measure at start-up)", type=int),
    Flag(
        "kv-cache-dtype",
        "kv_cache_dtype",
        "KV cache dtype: auto (the activation dtype) or fp8 (e4m3, per-tensor scales; twice the "
        "blocks of bf16 in the same memory)",
        choices=_str_choices(caps.KV_CACHE_DTYPE),
    ),
    Flag("prefix-caching", "prefix_caching", "reuse KV blocks of identical prompt prefixes", is_bool=True),
    Flag("max-num-seqs", "max_num_seqs", "maximum running sequences per step", type=int),
    Flag("max-num-batched-tokens", "max_num_batched_tokens", "token budget per engine step", type=int),
    Flag("chunked-prefill", "chunked_prefill", "split long prompts across steps", is_bool=True),
    Flag(
        "cuda-graphs",
        "cuda_graphs",
        "replay pure-decode steps of up to --max-num-seqs (at most 512) rows from CUDA graphs, one per "
        "batch-size bucket (1, 2, 4, then multiples of 8); CUDA and the triton backend only, not with "
        "tensor or pipeline parallelism",
        is_bool=True,
    ),
    Flag("max-queue-len", "max_queue_len", "waiting requests before answering 429", type=int),
    Flag(
        "max-request-body-bytes",
        "max_request_body_bytes",
        "largest request body read (413 above; 0: no limit)",
        type=int,
    ),
    *_READ_TIMEOUT_FLAGS,
    Flag("tensor-parallel-size", "tensor_parallel_size", "GPUs per tensor-parallel group", type=int),
    Flag("pipeline-parallel-size", "pipeline_parallel_size", "pipeline stages", type=int),
    Flag(
        "nnodes",
        "nnodes",
        "pods holding one replica's tensor x pipeline ranks (a LeaderWorkerSet group); each pod holds "
        "tensor x pipeline / nnodes consecutive ranks",
        type=int,
    ),
    Flag(
        "node-rank",
        "node_rank",
        "this pod's index in the group: 0 serves the API (the leader), others run only their ranks "
        "(-1: from $LWS_WORKER_INDEX, else 0)",
        type=int,
    ),
    Flag(
        "leader-address",
        "leader_address",
        "host of the group's leader pod, where the other pods join (empty: from $LWS_LEADER_ADDRESS; "
        "required on pods other than the leader)",
    ),
    Flag(
        "rendezvous-port",
        "rendezvous_port",
        "port the leader listens on (all interfaces) for the group's ranks to join (--nnodes > 1)",
        type=int,
    ),
    Flag("drain-timeout-seconds", "drain_timeout_seconds", "grace for in-flight requests on SIGTERM", type=float),
    Flag(
        "engine-step-timeout-seconds",
        "engine_step_timeout_seconds",
        "an engine step running longer than this (a wedged rank) fails /health and the in-flight "
        "requests (0: no watchdog)",
        type=float,
    ),
    Flag("kv-ttl-seconds", "kv_ttl_seconds", "prefill role: free unclaimed KV after this", type=float),
    Flag("seed", "seed", "default sampling seed", type=int),
    Flag(
        "speculative-method",
        "speculative_method",
        "speculative decoding: none, ngram (prompt lookup) or draft (a smaller model)",
        choices=_str_choices(caps.SPECULATIVE_METHOD),
    ),
    Flag("num-speculative-tokens", "num_speculative_tokens", "proposals verified per sequence and step", type=int),
    Flag(
        "speculative-max-num-seqs",
        "speculative_max_num_seqs",
        "speculate only in steps with at most this many decoding sequences",
        type=int,
    ),
    Flag(
        "speculative-draft-model",
        "speculative_draft_model",
        "draft model URI for --speculative-method draft (same vocabulary as the model)",
    ),
    Flag(
        "compat-hash", "compat_hash", "KV compatibility hash (image + model + KV layout); the router pairs equal hashes"
    ),
    Flag(
        "prefill-headers",
        "prefill_headers",
        "decode role: prefill where an endpoint picker's x-prefiller-host-port / x-gateway-prefill-endpoints "
        "header says (only behind a Gateway that sets them: spec.router.mode InferencePool)",
        is_bool=True,
    ),
    Flag(
        "prefill-timeout-seconds",
        "prefill_timeout_seconds",
        "decode role: total time a prefill pod named in a picker header has to answer (then "
        "this pod computes the prompt)",
        type=float,
    ),
    Flag(
        "handoff-key-file",
        "handoff_key_file",
        "file holding the InferenceService's KV handoff key: prefill signs kv_transfer_params with it, "
        "decode accepts only params signed with it",
    ),
    Flag(
        "rendezvous-key-file",
        "rendezvous_key_file",
        "--nnodes > 1: file holding a secret every pod of the group holds; the group's control messages "
        "are authenticated with a key derived from it and the leader's address (without it, a group "
        "of several pods may only meet on loopback addresses)",
    ),
)


def unsupported_serve_settings(args: ServeArgs) -> list[str]:
    """Messages for every setting in ``args`` that this version does not serve (the runtime
    refuses to start with them; the operator's CRD refuses them at admission)."""
    return caps.unsupported(
        [
            (caps.QUANTIZATION, args.quantization),
            (caps.SPECULATIVE_METHOD, args.speculative_method),
            (caps.TENSOR_PARALLEL_SIZE, args.tensor_parallel_size),
            (caps.PIPELINE_PARALLEL_SIZE, args.pipeline_parallel_size),
            (caps.DTYPE, args.dtype),
            (caps.KV_CACHE_DTYPE, args.kv_cache_dtype),
        ]
    )


@dataclasses.dataclass(frozen=True)
class RouterArgs:
    """Arguments of `splitserve router`."""

    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    policy: str = RoutingPolicy.PREFIX_AFFINITY.value
    session_header: str = defaults.SESSION_HEADER
    discovery: str = "static"  # static | kubernetes
    namespace: str = ""
    inference_service: str = ""
    prefill_endpoints: str = ""  # static: comma-separated host:port (HTTP); KV port from INFO_PATH
    decode_endpoints: str = ""
    aggregated_endpoints: str = ""
    model: str = ""  # tokenizer source for prefix hashing (same URI as the pools)
    served_model_name: str = ""
    block_size: int = defaults.BLOCK_SIZE
    short_prompt_threshold: int = defaults.SHORT_PROMPT_THRESHOLD
    prefill_overflow_tokens: int = 0
    health_interval_seconds: float = defaults.ROUTER_HEALTH_INTERVAL_SECONDS
    request_timeout_seconds: float = 600.0
    prefill_timeout_seconds: float = defaults.PREFILL_TIMEOUT_SECONDS
    max_request_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES
    header_timeout_seconds: float = defaults.HEADER_TIMEOUT_SECONDS
    body_idle_timeout_seconds: float = defaults.BODY_IDLE_TIMEOUT_SECONDS
    engine: str = DEFAULT_ENGINE.value  # the pods' engine (Engine): how they are polled


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
    Flag(
        "short-prompt-threshold",
        "short_prompt_threshold",
        "send prompts shorter than this straight to decode (0: never)",
        type=int,
    ),
    Flag(
        "prefill-overflow-tokens",
        "prefill_overflow_tokens",
        "prefill on a decode pod when every prefill pod has this many prompt tokens queued (0: never)",
        type=int,
    ),
    Flag("health-interval-seconds", "health_interval_seconds", "pod health-check period", type=float),
    Flag("request-timeout-seconds", "request_timeout_seconds", "upper bound for one upstream request", type=float),
    Flag(
        "prefill-timeout-seconds",
        "prefill_timeout_seconds",
        "total time a disaggregated request's prefill may take (then a decode pod computes the prompt)",
        type=float,
    ),
    Flag(
        "max-request-body-bytes",
        "max_request_body_bytes",
        "largest request body read (413 above; 0: no limit)",
        type=int,
    ),
    *_READ_TIMEOUT_FLAGS,
    Flag(
        "engine",
        "engine",
        "serving engine of the pods (one per InferenceService): which paths and gauges say a pod's "
        "health and load, and which handoff parameters a prefill pod answers",
        choices=tuple(e.value for e in Engine),
    ),
)


def add_arguments(parser: argparse.ArgumentParser, flags: Sequence[Flag], defaults_obj: Any) -> None:
    """Add ``flags`` to ``parser`` with defaults read from ``defaults_obj`` (a dataclass)."""
    for flag in flags:
        default = getattr(defaults_obj, flag.dest)
        if flag.is_bool:
            parser.add_argument(
                f"--{flag.name}",
                dest=flag.dest,
                default=default,
                action=argparse.BooleanOptionalAction,
                help=flag.help,
            )
        else:
            parser.add_argument(
                f"--{flag.name}",
                dest=flag.dest,
                default=default,
                type=flag.type,
                choices=flag.choices,
                help=f"{flag.help} (default: {default!r})",
            )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, SERVE_FLAGS, ServeArgs())


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, ROUTER_FLAGS, RouterArgs())


def serve_args_from_namespace(ns: argparse.Namespace) -> ServeArgs:
    return ServeArgs(**{f.dest: getattr(ns, f.dest) for f in SERVE_FLAGS})


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    return RouterArgs(**{f.dest: getattr(ns, f.dest) for f in ROUTER_FLAGS})


def _argv(flags: Sequence[Flag], args: Any, defaults_obj: Any) -> list[str]:
    """Render only the flags whose value differs from the default, in table order."""
    out: list[str] = []
    for flag in flags:
        value = getattr(args, flag.dest)
        if value == getattr(defaults_obj, flag.dest):
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
    """`splitserve router` arguments for `args`."""
    return _argv(ROUTER_FLAGS, args, RouterArgs())
