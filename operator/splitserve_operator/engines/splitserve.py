"""Pods of the bundled runtime: ``splitserve serve`` with its flags (:class:`ServeArgs`).

Why its own module: the bundled runtime is one engine among others (:mod:`.pod`); what is
particular to it lives here: the KV transfer port and the handoff key of prefill and decode
pods, the rendezvous of multi-node replicas, the Triton cache, the runtime's drain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import Role
from splitserve_contract.engines import Engine

from .. import handoff_key, inference_pool, leader_worker_set
from ..api import InferenceService, PoolSpec
from . import pod


def uses_handoff_key(role: Role) -> bool:
    """Prefill signs the KV handoff and decode verifies it; nobody else holds the key."""
    return role in (Role.PREFILL, Role.DECODE)


def serve_args(*, isvc: InferenceService, role: Role, pool: PoolSpec, compat_hash: str) -> contract.ServeArgs:
    """The `splitserve serve` arguments of one pool (before the extraArgs). The compat hash
    goes on the command line too: pods report it and the router pairs only equal hashes.
    Prefill and decode get the KV handoff key file (:mod:`..handoff_key`); decode and
    aggregated pods the speculative decoding settings (:func:`.pod.speculates`)."""
    spec = isvc.spec
    model, _, _ = pod.model_location(spec.model.uri)
    scheduling = spec.pool_scheduling(pool)
    return contract.ServeArgs(
        model=model,
        served_model_name=pod.served_name(isvc),
        revision=spec.model.revision or "",
        role=role.value,
        host=f"$({contract.ENV_POD_IP})",
        port=contract.HTTP_PORT,
        kv_port=contract.KV_TRANSFER_PORT,
        device="cuda" if pool.resources.gpus > 0 else "cpu",
        dtype=spec.model.dtype,
        quantization=spec.model.quantization,
        max_model_len=spec.model.max_model_len or 0,
        block_size=spec.kv_cache.block_size,
        kv_memory_fraction=spec.kv_cache.memory_fraction,
        prefix_caching=spec.kv_cache.prefix_caching,
        kv_cache_dtype=spec.kv_cache.dtype,
        max_num_seqs=scheduling.max_num_seqs,
        max_num_batched_tokens=scheduling.max_batched_tokens,
        chunked_prefill=scheduling.chunked_prefill,
        tensor_parallel_size=pool.parallelism.tensor,
        pipeline_parallel_size=pool.parallelism.pipeline,
        compat_hash=compat_hash,
        handoff_key_file=handoff_key.KEY_FILE if uses_handoff_key(role) else "",
        prefill_headers=role is Role.DECODE and inference_pool.enabled(spec),
        **_speculative_args(isvc=isvc, role=role),
        **_multi_node_args(pool),
    )


def _multi_node_args(pool: PoolSpec) -> dict[str, Any]:
    """``--nnodes`` for a replica of several pods. Each pod's node rank and its group's leader
    come from the env the LWS pod webhook injects (``LWS_WORKER_INDEX``,
    ``LWS_LEADER_ADDRESS``), which the runtime reads when the flags are left out: one pod
    template serves the leader and every worker."""
    return (
        {"nnodes": pool.resources.pods_per_replica, "rendezvous_key_file": leader_worker_set.RENDEZVOUS_KEY_FILE}
        if pool.resources.multi_node
        else {}
    )


def _speculative_args(*, isvc: InferenceService, role: Role) -> dict[str, Any]:
    if not pod.speculates(isvc, role):
        return {}
    speculative = isvc.spec.scheduling_settings.speculative
    args: dict[str, Any] = {
        "speculative_method": speculative.method,
        "num_speculative_tokens": speculative.num_tokens,
        "speculative_max_num_seqs": speculative.max_num_seqs,
    }
    if speculative.draft_model:
        args["speculative_draft_model"], _, _ = pod.draft_model_location(isvc)
    return args


class SplitserveRenderer:
    """:class:`.pod.EngineRenderer` of the bundled runtime."""

    engine: Final = Engine.SPLITSERVE

    def kv_ports(self, pool: PoolSpec) -> list[dict[str, Any]]:
        """Every rank of a parallel prefill pod serves its own slice of the KV on the KV port +
        its index within the pod (the runtime's ``engine.parallel.rank_kv``)."""
        ranks = pool.parallelism.tensor * pool.parallelism.pipeline // pool.resources.pods_per_replica
        port: dict[str, Any] = {"protocol": "TCP", "port": contract.KV_TRANSFER_PORT}
        if ranks > 1:
            port["endPort"] = contract.KV_TRANSFER_PORT + ranks - 1
        return [port]

    def container(self, *, isvc: InferenceService, role: Role, pool: PoolSpec, compat_hash: str) -> pod.PoolContainer:
        args = serve_args(isvc=isvc, role=role, pool=pool, compat_hash=compat_hash)
        extra = pod.extra_args(isvc, pool)
        volumes: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        for volume, mount in (pod.shared_memory_volume(), pod.triton_cache_volume()):
            volumes.append(volume)
            mounts.append(mount)
        ports: list[dict[str, Any]] = []
        if role is not Role.AGGREGATED:
            ports.append(
                {"name": contract.KV_TRANSFER_PORT_NAME, "containerPort": contract.KV_TRANSFER_PORT, "protocol": "TCP"}
            )
        if pool.resources.multi_node:
            ports.append(
                {
                    "name": leader_worker_set.RENDEZVOUS_PORT_NAME,
                    "containerPort": args.rendezvous_port,
                    "protocol": "TCP",
                }
            )
        if uses_handoff_key(role) or pool.resources.multi_node:  # a group's rendezvous key too
            volumes.append(handoff_key.volume(isvc.metadata.name))
            mounts.append(handoff_key.volume_mount())
        _, draft_volume, draft_mount = pod.draft_model_location(isvc)
        if pod.speculates(isvc, role) and draft_volume is not None and draft_mount is not None:
            volumes.append(draft_volume)
            mounts.append(draft_mount)
        return pod.PoolContainer(
            # `args`, not `command`: the image's ENTRYPOINT (tini) stays PID 1, forwarding SIGTERM
            # (the runtime drains on it) and reaping Triton's compiler children.
            command=None,
            args=["splitserve", "serve", *contract.serve_argv(args), *extra],
            env=pod.env(isvc=isvc),
            ports=ports,
            volumes=volumes,
            mounts=mounts,
            grace_seconds=int(args.drain_timeout_seconds) + pod.TERMINATION_GRACE_MARGIN_SECONDS,
            config={"serveArgs": dataclasses.asdict(args), "extraArgs": extra},
        )


RENDERER: Final = SplitserveRenderer()
