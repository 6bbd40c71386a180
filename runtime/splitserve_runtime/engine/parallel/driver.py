"""Rank 0's side of starting a parallel engine (tensor and/or pipeline): workers, group,
this rank's part of the model, engine.

The order matters: the workers are started first (they join the group, then load their shards
while rank 0 loads its own), every rank measures the KV cache in lock-step and takes the
smallest block count, and only then is the engine built, with a runner that drives the other
ranks. If rank 0 fails on the way, the workers are stopped with it.

On the leader of a multi-pod group (:mod:`.placement`) rank 0 starts only its own pod's other
ranks, hosts the group's store on the rendezvous port, waits for the other pods' ranks to join,
and watches those pods' heartbeats (:mod:`.liveness`) for as long as it runs. Where the store
listens and the key of the group's control messages are :mod:`.rendezvous`'s: a one-pod
replica on loopback under a key drawn here, a group of pods under ``--rendezvous-key-file``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlparse

import torch

from splitserve_contract import ServeArgs
from splitserve_contract.capabilities import UnsupportedError
from splitserve_contract.model_config import ModelConfig

from ...model.pipeline import PipelineStage
from ...model.tensor_parallel import check_divisible
from ..config import EngineConfig
from ..serve_settings import text_settings
from . import exit_hooks, rendezvous
from .failure import GroupFailure
from .group import INIT_TIMEOUT, ParallelGroup, init_group
from .launcher import free_init_method, start_workers, worker_died_message
from .liveness import Heartbeat
from .placement import Placement, PlacementError, pin, resolve_placement
from .rendezvous import Rendezvous
from .runner import ParallelRunner
from .worker import load_rank, rank_device

if TYPE_CHECKING:
    from ..llm_engine import LLMEngine

log = logging.getLogger(__name__)


def parallel_engine(
    args: ServeArgs,
    *,
    model_dir: Path,
    model_config: ModelConfig,
    device: torch.device,
    engine_class: Callable[..., LLMEngine],
) -> LLMEngine:
    """An ``engine_class`` whose model runs on ``tensor × pipeline`` ranks (this process is rank 0)."""
    if args.speculative_method == "draft":
        raise UnsupportedError(
            "speculative decoding with a draft model is not supported with tensor or "
            "pipeline parallelism yet (ngram is)"
        )
    check_divisible(model_config, args.tensor_parallel_size)
    PipelineStage(config=model_config, stage=0, num_stages=args.pipeline_parallel_size)  # fits the layers
    placement = resolve_placement(args)
    if not placement.is_leader:
        raise PlacementError(
            f"node rank {placement.node_rank} of a {placement.nnodes}-pod group runs only its "
            f"ranks (`splitserve serve` does that there), not an engine"
        )
    args = pin(args, placement)
    meeting = rendezvous.multinode(args, placement) if placement.is_multinode else rendezvous.one_pod()
    if not placement.is_multinode:
        init_method = free_init_method()
    elif meeting.store_host is not None:  # a keyless group on one machine: the store listens there only
        init_method = local_init_method(meeting.store_host, placement.rendezvous_port)
    else:
        init_method = placement.init_method()
    failure = GroupFailure()

    # The group's ways out run the exit hooks first (the engine fails its streams, the server
    # lets them send their error event), so no request in flight ends with a cut connection.
    def worker_died(rank: int, code: int) -> None:
        exit_hooks.run(worker_died_message(rank, code))
        failure.worker_died(rank, code)

    def broken(symptom: str) -> NoReturn:
        exit_hooks.run(f"the parallel group broke: {symptom}")
        failure(symptom)

    workers = start_workers(
        args,
        model_dir=model_dir,
        init_method=init_method,
        rendezvous=meeting,
        ranks=placement.local_ranks[1:],
        on_death=worker_died,
    )
    failure.workers = workers
    try:
        group = _join(placement, args=args, init_method=init_method, device=rank_device(device, 0), meeting=meeting)
        if placement.is_multinode:
            store_host = urlparse(init_method).hostname
            assert store_host is not None
            failure.heartbeat = Heartbeat(
                host=store_host,
                port=placement.rendezvous_port,
                node=0,
                peers=placement.remote_nodes(),
                describe=placement.describe_node,
                on_lost=broken,
                wait_for_first_beat=False,
            ).start()
        loaded = load_rank(args, model_dir=model_dir, group=group)
        config = EngineConfig.from_serve_args(
            dataclasses.replace(args, num_kv_blocks=loaded.num_blocks), max_model_len=loaded.max_model_len
        )
        engine = engine_class(
            model=loaded.model,
            kv_spec=loaded.spec,
            vocab_size=model_config.vocab_size,
            config=config,
            device=group.device,
            **text_settings(args, model_dir=model_dir, model_config=model_config),
            runner_factory=functools.partial(
                ParallelRunner,
                group=group,
                loaded=loaded,
                workers=workers,
                on_failure=broken,
                exit_on_forward_error=placement.is_multinode,
            ),
        )
    except BaseException:
        if failure.heartbeat is not None:
            failure.heartbeat.stop()
        workers.kill()
        raise
    runner = engine.runner
    assert isinstance(runner, ParallelRunner)
    engine.on_close.append(runner.close)
    if failure.heartbeat is not None:
        engine.on_close.append(failure.heartbeat.stop)

    def abandon() -> None:  # a process that ends without close() leaves no worker behind
        runner.abandon()
        workers.kill()

    atexit.register(abandon)
    return engine


def local_init_method(host: str, port: int) -> str:
    """``tcp://host:port``, an IPv6 literal in brackets."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _join(
    placement: Placement, *, args: ServeArgs, init_method: str, device: torch.device, meeting: Rendezvous
) -> ParallelGroup:
    """Rank 0 joins (and, as the store's host, waits for) every rank of the group."""
    if placement.is_multinode:
        log.info(
            "waiting up to %.0f s for the group's %d ranks on %d pods to join at port %d",
            INIT_TIMEOUT.total_seconds(),
            placement.world_size,
            placement.nnodes,
            placement.rendezvous_port,
        )
    try:
        return init_group(
            rank=0,
            tp_size=args.tensor_parallel_size,
            num_stages=args.pipeline_parallel_size,
            init_method=init_method,
            device=device,
            rendezvous=meeting,
        )
    except RuntimeError as exc:
        if not placement.is_multinode:
            raise
        raise RuntimeError(
            f"the group's {placement.world_size} ranks on {placement.nnodes} pods did not all join "
            f"at rendezvous port {placement.rendezvous_port} within "
            f"{INIT_TIMEOUT.total_seconds():.0f} s: {exc}"
        ) from exc
