"""Pods of vLLM: ``vllm serve`` with the flags the spec maps to (:func:`vllm_argv`).

Why its own module: a vLLM pool is the same pod as the bundled runtime's (:mod:`.pod`: the
restricted security context, the model cache, the Secrets by reference) running another
program, so only its command line and its environment are here. Each spec field is rendered
to vLLM's own option for it; values vLLM has no option for are refused at admission
(:mod:`..api.engine_rules`), never dropped here.

- The model: ``hf://org/name`` is vLLM's ``org/name``, downloaded by vLLM's hub client into
  the model cache (``HF_HUB_CACHE``) from ``HF_ENDPOINT`` with ``HF_TOKEN`` (the same variables
  the bundled runtime reads); ``pvc://`` and ``file://`` are local paths.
- The API key: vLLM reads ``VLLM_API_KEY`` (from ``runtime.apiKeySecretRef``, by reference).
- Caches: vLLM, torch.compile and Triton write under ``HOME`` (``/tmp``) and the cache
  volumes, so the root file system stays read-only, as for the bundled runtime.
- The command is ``vllm serve`` explicitly, so the upstream ``vllm/vllm-openai`` image and the
  local CPU image (Containerfile.vllm) run the same way whatever their entrypoints.
- Prefill and decode pools hand the prompt's KV over with vLLM's ``NixlConnector``
  (:func:`kv_transfer_config`): every pod is ``kv_both``, a decode pod that cannot load the KV
  computes the prompt itself (``kv_load_failure_policy: recompute``, the router's fallback
  rule), the side channel listens on the pod's IP at a fixed port and UCX on a fixed port range,
  which the NetworkPolicies open to the other pool only (:meth:`VllmRenderer.kv_ports`).
"""

from __future__ import annotations

import json
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import Role, ServeArgs
from splitserve_contract.engines import VLLM_KV_DATA_PORTS, VLLM_KV_SIDE_CHANNEL_PORT, Engine

from ..api import InferenceService, PoolSpec
from ..api.fields import parse_quantity
from . import pod

PRE_STOP_SECONDS: Final = 5
"""On SIGTERM vLLM starts shutting down at once: requests that arrive after it fail 500
("cannot schedule new futures after shutdown") while its /health still answers 200, so neither
a router nor a load balancer can tell. A terminating pod first waits this long (its preStop
hook), out of its Service's endpoints, so that the router (which watches them) has stopped
sending before vLLM sees the signal; the drain then only finishes what was in flight."""
VLLM_CACHE_DIR: Final = "/var/cache/splitserve/vllm"
VLLM_COMMAND: Final = ("vllm", "serve")
_DRAIN_SECONDS: Final = int(ServeArgs().drain_timeout_seconds)
"""How long vLLM may finish its in-flight requests on SIGTERM (``--shutdown-timeout``; vLLM's
default, 0, aborts them at once: every scale-down would fail what the pod was serving); the
router stops sending first (the pod leaves its Service's endpoints). The bundled runtime's
drain, with the same grace."""


def model_argument(uri: str) -> str:
    """``hf://org/name`` -> ``org/name``; ``file:///path`` (and a claim's mount) -> ``/path``."""
    location, _, _ = pod.model_location(uri)
    if location.startswith("hf://"):
        return location.removeprefix("hf://")
    return location.removeprefix("file://")


def speculative_config(isvc: InferenceService, role: Role) -> dict[str, Any] | None:
    """vLLM's ``--speculative-config`` for pools that decode; None without speculation."""
    if not pod.speculates(isvc, role):
        return None
    speculative = isvc.spec.scheduling_settings.speculative
    if speculative.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": speculative.num_tokens}
    draft, _, _ = pod.draft_model_location(isvc)
    return {"method": "draft_model", "model": model_argument(draft), "num_speculative_tokens": speculative.num_tokens}


def kv_transfer_config(pool: PoolSpec) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` of a prefill or decode pool (module docstring); on CPU
    pools the KV is registered with NIXL in host memory."""
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    if pool.resources.gpus == 0:
        config["kv_buffer_device"] = "cpu"
    return config


def vllm_argv(*, isvc: InferenceService, role: Role, pool: PoolSpec) -> list[str]:
    """The ``vllm serve`` arguments of one pool (before the extraArgs)."""
    spec = isvc.spec
    scheduling = spec.pool_scheduling(pool)
    argv = [
        model_argument(spec.model.uri),
        "--served-model-name",
        pod.served_name(isvc),
        "--host",
        f"$({contract.ENV_POD_IP})",
        "--port",
        str(contract.HTTP_PORT),
        "--dtype",
        spec.model.dtype,
    ]
    if spec.model.revision:
        argv += ["--revision", spec.model.revision]
    if spec.model.quantization != "none":
        argv += ["--quantization", spec.model.quantization]
    if spec.model.max_model_len:
        argv += ["--max-model-len", str(spec.model.max_model_len)]
    argv += [
        "--block-size",
        str(spec.kv_cache.block_size),
        "--gpu-memory-utilization",
        str(spec.kv_cache.memory_fraction),
        "--enable-prefix-caching" if spec.kv_cache.prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-dtype",
        spec.kv_cache.dtype,
        "--max-num-seqs",
        str(scheduling.max_num_seqs),
        "--max-num-batched-tokens",
        str(scheduling.max_batched_tokens),
        "--enable-chunked-prefill" if scheduling.chunked_prefill else "--no-enable-chunked-prefill",
        "--tensor-parallel-size",
        str(pool.parallelism.tensor),
        "--pipeline-parallel-size",
        str(pool.parallelism.pipeline),
        "--shutdown-timeout",
        str(_DRAIN_SECONDS),
    ]
    config = speculative_config(isvc, role)
    if config is not None:
        argv += ["--speculative-config", _json(config)]
    if role in (Role.PREFILL, Role.DECODE):
        argv += ["--kv-transfer-config", _json(kv_transfer_config(pool))]
    return argv


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _kv_transfer_env(pool: PoolSpec) -> list[dict[str, Any]]:
    """NixlConnector's side channel on the pod's IP and fixed port, and UCX's listening ports
    (on CPU pools over TCP, the only transport there)."""
    first, last = VLLM_KV_DATA_PORTS
    out = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": f"$({contract.ENV_POD_IP})"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(VLLM_KV_SIDE_CHANNEL_PORT)},
        {"name": "UCX_TCP_PORT_RANGE", "value": f"{first}-{last}"},
    ]
    if pool.resources.gpus == 0:
        out.append({"name": "UCX_TLS", "value": "tcp"})
    return out


def _engine_env(isvc: InferenceService, role: Role, pool: PoolSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HUB_CACHE", "value": pod.MODEL_CACHE_DIR},
        {"name": "VLLM_CACHE_ROOT", "value": VLLM_CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": pod.TRITON_CACHE_DIR},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
    ]
    if pool.resources.gpus == 0:
        # vLLM's CPU build pins its compute threads to cores it picks as if it owned the node
        # (and keeps one in reserve); pods sharing a node (no CPU manager) then all pin to the
        # same core. Unpinned, the kernel spreads them over the pod's CPU quota, and as many
        # threads as the pod's CPU request keeps them from fighting over every core of the
        # node (one per core of the node by default: measured on two shared cores, a burst's
        # p50 latency went from 13 s to 95 s and some requests timed out).
        out.append({"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"})
        if pool.resources.cpu is not None:
            threads = max(1, int(parse_quantity(pool.resources.cpu)))
            out.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    if role in (Role.PREFILL, Role.DECODE):
        out += _kv_transfer_env(pool)
    api_key = isvc.spec.runtime.api_key_secret_ref
    if api_key is not None:
        out.append(pod.secret_env("VLLM_API_KEY", api_key.name, api_key.key))
    return out


def _kv_container_ports(role: Role) -> list[dict[str, Any]]:
    if role is Role.AGGREGATED:
        return []
    # named as the bundled runtime's KV port, which the pool's Service targets by name
    return [{"name": contract.KV_TRANSFER_PORT_NAME, "containerPort": VLLM_KV_SIDE_CHANNEL_PORT, "protocol": "TCP"}]


class VllmRenderer:
    """:class:`.pod.EngineRenderer` of vLLM."""

    engine: Final = Engine.VLLM

    def kv_ports(self, pool: PoolSpec) -> list[dict[str, Any]]:
        del pool  # one NIXL agent per pod, whatever its parallelism
        first, last = VLLM_KV_DATA_PORTS
        return [
            {"protocol": "TCP", "port": VLLM_KV_SIDE_CHANNEL_PORT},
            {"protocol": "TCP", "port": first, "endPort": last},
        ]

    def container(self, *, isvc: InferenceService, role: Role, pool: PoolSpec, compat_hash: str) -> pod.PoolContainer:
        del compat_hash  # vLLM pods report no compat hash: the router pairs any prefill and decode pod
        argv = vllm_argv(isvc=isvc, role=role, pool=pool)
        extra = pod.extra_args(isvc, pool)
        volumes: list[dict[str, Any]] = [{"name": "vllm-cache", "emptyDir": {}}]
        mounts: list[dict[str, Any]] = [{"name": "vllm-cache", "mountPath": VLLM_CACHE_DIR}]
        for volume, mount in (pod.shared_memory_volume(), pod.triton_cache_volume()):
            volumes.append(volume)
            mounts.append(mount)
        _, draft_volume, draft_mount = pod.draft_model_location(isvc)
        if pod.speculates(isvc, role) and draft_volume is not None and draft_mount is not None:
            volumes.append(draft_volume)
            mounts.append(draft_mount)
        return pod.PoolContainer(
            command=list(VLLM_COMMAND),
            args=[*argv, *extra],
            env=pod.env(isvc=isvc, engine_env=_engine_env(isvc, role, pool)),
            ports=_kv_container_ports(role),
            volumes=volumes,
            mounts=mounts,
            grace_seconds=PRE_STOP_SECONDS + _DRAIN_SECONDS + pod.TERMINATION_GRACE_MARGIN_SECONDS,
            # exec, not the sleep action (Kubernetes 1.30+): any cluster, and both images have sleep
            lifecycle={"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
            config={"command": [*VLLM_COMMAND], "args": argv, "extraArgs": extra},
        )


RENDERER: Final = VllmRenderer()
