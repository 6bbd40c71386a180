"""A parallel rank's part of the model, and the loop a worker rank (1..N-1) runs.

:func:`load_rank` is what every rank does to become ready, the driver included: load its
part (its pipeline stage's layers, its tensor-parallel shard of them), size the KV cache
(every rank measures in lock-step, because a CUDA measurement runs a forward with
collectives), and agree on the smallest block count. A worker then executes the driver's
messages until told to stop; it has no scheduler, sampler or HTTP server.

Started as ``python -m splitserve_runtime.engine.parallel.worker`` by :mod:`.launcher` (on the
leader's pod by the server, on a worker pod of a multi-pod group by its agent, :mod:`.node`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from splitserve_contract import ServeArgs
from splitserve_contract.model_config import load_model_config

from ...model.loader import load_model
from ...model.pipeline import PipelineStage
from ...model.tensor_parallel import TensorParallelLayout
from ...ops import get_ops
from ..kv_budget import KVCacheSpec, resolve_kv_cache_dtype
from ..model_runner import allocate_kv_caches, measure_num_kv_blocks
from ..serve_settings import resolve_device, resolve_dtype
from ..step_inputs import KVCaches, StepRows
from . import control, pipeline
from .group import ParallelGroup, init_group
from .kv_slices import PullReport
from .liveness import LEADER_WAIT_SECONDS, mark_ready, wait_for_leader
from .placement import resolve_placement
from .rank_kv import RankKV, report_key
from .rendezvous import ControlAuthError, Rendezvous, from_environment

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankModel:
    """One rank's loaded part and its KV cache shape."""

    model: pipeline.StageModel
    part: control.KVPart
    spec: KVCacheSpec
    num_blocks: int
    max_model_len: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype

    def forward_logits(
        self, group: ParallelGroup, *, rows: StepRows, caches: KVCaches, block_size: int
    ) -> torch.Tensor | None:
        """One step on this rank: the logits of the sampled rows on the driver (None elsewhere
        or when none is sampled). Without pipeline stages every rank runs the whole forward
        (the tensor-parallel collectives meet inside it) and computes the logits."""
        if group.num_stages > 1:
            return pipeline.run_step(
                group,
                model=self.model,
                caches=caches,
                rows=rows,
                block_size=block_size,
                hidden_size=self.hidden_size,
                vocab_size=self.vocab_size,
                dtype=self.dtype,
            )
        inputs = rows.build(block_size=block_size, device=group.device)
        hidden = self.model.forward(
            input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=caches, md=inputs.md
        )
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])  # the vocabulary gather


def rank_device(device: torch.device, local_index: int) -> torch.device:
    """``cuda`` → this rank's GPU (one per rank, in order within its pod); CPU stays CPU."""
    return torch.device("cuda", local_index) if device.type == "cuda" else device


def load_rank(args: ServeArgs, *, model_dir: Path, group: ParallelGroup) -> RankModel:
    """Load this rank's part of ``model_dir`` and agree on the KV block count (every rank
    calls this at the same point)."""
    device = group.device
    if device.type == "cpu":  # the pod's ranks share its host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, group.size // max(1, args.nnodes))))
    config = load_model_config(model_dir=model_dir)
    stage = (
        PipelineStage(config=config, stage=group.stage, num_stages=group.num_stages) if group.num_stages > 1 else None
    )
    staged = stage.local_config() if stage is not None else config
    layout = TensorParallelLayout(config=staged, rank=group.tp_rank, size=group.tp_size)
    dtype = resolve_dtype(args.dtype, device=device, config_dtype=config.torch_dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype=dtype, device=device)
    max_model_len = config.resolve_max_model_len(requested_tokens=args.max_model_len)
    if not args.chunked_prefill:
        max_model_len = min(max_model_len, args.max_num_batched_tokens)
    ops = get_ops(name=args.attention_backend, device=device)
    model = load_model(
        model_dir=model_dir,
        ops=ops,
        dtype=dtype,
        device=device,
        config=config,
        quantization=args.quantization,
        parallel=(layout, group) if group.tp_size > 1 else None,
        stage=stage,
    )
    spec = KVCacheSpec(
        num_layers=staged.num_hidden_layers, num_kv_heads=layout.num_kv_heads, head_dim=config.head_dim, dtype=kv_dtype
    )
    num_blocks = args.num_kv_blocks or measure_num_kv_blocks(
        model=model,
        spec=spec,
        device=device,
        block_size=args.block_size,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
    )
    agreed = min(group.all_gather_object(num_blocks))
    return RankModel(
        model=model,
        part=control.KVPart(layout=layout, stage=stage),
        spec=spec,
        num_blocks=agreed,
        max_model_len=max_model_len,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dtype=dtype,
    )


DRIVER_GONE_STATUS = 69
"""A worker rank's exit status when the driver (rank 0) went away without a Stop (EX_UNAVAILABLE)."""


def serve_worker(args: ServeArgs, *, model_dir: Path, rank: int, init_method: str, rendezvous: Rendezvous) -> int:
    """A worker rank's whole life: join, load, execute the driver's messages, leave. Returns
    the exit status: 0 when told to stop, :data:`DRIVER_GONE_STATUS` when the driver is gone."""
    placement = resolve_placement(args, env={})  # the launcher passes the placement in args
    device = rank_device(resolve_device(args.device), placement.local_index(rank))
    if not placement.is_leader:  # another pod's store: wait for it quietly (the store's own retries are loud),
        # a little longer than the pod's agent, whose message says more when the leader never comes
        wait_for_leader(placement.leader_address, placement.rendezvous_port, timeout_s=LEADER_WAIT_SECONDS + 60)
    group = init_group(
        rank=rank,
        tp_size=args.tensor_parallel_size,
        num_stages=args.pipeline_parallel_size,
        init_method=init_method,
        device=device,
        rendezvous=rendezvous,
    )
    loaded = load_rank(args, model_dir=model_dir, group=group)
    caches = allocate_kv_caches(
        spec=loaded.spec, num_blocks=loaded.num_blocks, block_size=args.block_size, device=group.device
    )
    rank_kv = RankKV.for_rank(
        args,
        group=group,
        part=loaded.part,
        dtype=loaded.spec.dtype,
        head_dim=loaded.spec.head_dim,
        local_index=placement.local_index(rank),
    )
    mark_ready(group.store, rank)
    log.info("parallel rank %d ready: %d KV blocks", rank, loaded.num_blocks)
    try:
        return _execute(group, loaded=loaded, caches=caches, rank_kv=rank_kv, block_size=args.block_size)
    finally:
        if rank_kv is not None:
            rank_kv.close()


def _execute(
    group: ParallelGroup, *, loaded: RankModel, caches: KVCaches, rank_kv: RankKV | None, block_size: int
) -> int:
    """Execute the driver's messages until Stop (0) or the driver is gone."""
    while True:
        try:
            message = control.receive(group)
        except ControlAuthError as exc:  # not the group's driver: never decoded, never run
            log.error("parallel rank %d: %s; exiting", group.rank, exc)
            return DRIVER_GONE_STATUS
        except RuntimeError as exc:  # the driver is gone (its connection closed)
            log.warning("parallel rank %d: the driver is gone (%s); exiting", group.rank, exc)
            return DRIVER_GONE_STATUS
        if isinstance(message, control.Ping):
            continue
        if isinstance(message, control.Step):
            with torch.inference_mode():
                loaded.forward_logits(group, rows=message.rows, caches=caches, block_size=block_size)
        elif isinstance(message, control.ReadBlocks):
            control.gather_blocks(group, loaded.part, caches, message.block_ids)
        elif isinstance(message, control.WriteBlocks):
            control.write_blocks(group, loaded.part, caches, message.blocks)
        elif isinstance(message, control.ExportBlocks):
            group.all_gather_object(_export(rank_kv, message, caches))
        elif isinstance(message, control.DropExports):
            if rank_kv is not None:
                rank_kv.drop(message.request_ids)
        elif isinstance(message, control.PullBlocks):
            if rank_kv is None:  # the driver sends none to an aggregated pod; answer anyway
                group.store.set(
                    report_key(message.order.pull_id, group.rank),
                    PullReport(
                        rank=group.rank, ok=False, code="protocol", message="this rank takes no KV handoff"
                    ).to_json(),
                )
            else:
                rank_kv.pull(message.order, caches)
        else:
            return 0


def _export(rank_kv: RankKV | None, message: control.ExportBlocks, caches: KVCaches) -> tuple[bool, str]:
    """(True, this rank's KV endpoint) once its part of the export is served, else (False, why)."""
    if rank_kv is None:
        return False, "this rank takes no KV handoff"
    try:
        return True, rank_kv.export(
            request_id=message.request_id, block_ids=message.block_ids, num_tokens=message.num_tokens, caches=caches
        )
    except (RuntimeError, ValueError) as exc:
        return False, str(exc)


PARENT_POLL_SECONDS = 0.5


def exit_with_parent() -> None:
    """End this worker as soon as the server that started it is gone (re-parented), so no
    worker outlives its server, whatever killed the server."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_argv(args: ServeArgs, *, model_dir: Path, rank: int, init_method: str, loopback: bool) -> list[str]:
    """The command line :func:`main` parses (the group's shape comes with ``args``; its key
    comes in the environment, :mod:`.rendezvous`)."""
    return [
        sys.executable,
        "-m",
        __name__,
        "--rank",
        str(rank),
        "--init-method",
        init_method,
        "--model-dir",
        str(model_dir),
        *(["--loopback"] if loopback else []),
        "--serve-args",
        json.dumps(dataclasses.asdict(args)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a parallel worker rank (started by splitserve serve)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--serve-args", required=True, help="ServeArgs as JSON")
    parser.add_argument(
        "--loopback", action="store_true", help="every rank of the group runs on this machine: listen on loopback only"
    )
    ns = parser.parse_args(argv)
    group_rendezvous = from_environment(loopback=ns.loopback)
    exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{ns.rank} %(levelname)s %(name)s: %(message)s")
    args = ServeArgs(**json.loads(ns.serve_args))
    code = serve_worker(
        args, model_dir=ns.model_dir, rank=ns.rank, init_method=ns.init_method, rendezvous=group_rendezvous
    )
    # Exit now: the interpreter's teardown of torch's modules takes seconds on a loaded host,
    # and the server (or the pod's agent) waits for its stopped ranks.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
