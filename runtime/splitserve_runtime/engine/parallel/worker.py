"""A tensor-parallel rank's shard of the model, and the loop a worker rank (1..N-1) runs.

:func:`load_rank` is what every rank does to become ready, the driver included: load its
shard, size the KV cache (every rank measures in lock-step, because a CUDA measurement runs a
forward with collectives), and agree on the smallest block count. A worker then executes the
driver's messages until told to stop; it has no scheduler, sampler or HTTP server.

Started as ``python -m splitserve_runtime.engine.parallel.worker`` by :mod:`.launcher`.
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

from ...model.tensor_parallel import TensorParallelLayout
from ..kv_budget import KVCacheSpec, resolve_kv_cache_dtype
from ..model_runner import CausalLM, allocate_kv_caches, measure_num_kv_blocks
from . import control
from .group import TensorParallelGroup, init_group

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankModel:
    """One rank's loaded shard and its KV cache shape."""

    model: CausalLM
    layout: TensorParallelLayout
    spec: KVCacheSpec
    num_blocks: int
    max_model_len: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """``cuda`` → this rank's GPU (one per rank, in order); CPU stays CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def load_rank(args: ServeArgs, *, model_dir: Path, group: TensorParallelGroup) -> RankModel:
    """Load this rank's shard of ``model_dir`` and agree on the KV block count (every rank
    calls this at the same point)."""
    from splitserve_contract.model_config import load_model_config

    from ...model.loader import load_model
    from ...ops import get_ops
    from ..loading import resolve_dtype

    device = group.device
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.size))
    config = load_model_config(model_dir=model_dir)
    layout = TensorParallelLayout(config=config, rank=group.rank, size=group.size)
    dtype = resolve_dtype(args.dtype, device=device, config_dtype=config.torch_dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype=dtype, device=device)
    max_model_len = config.resolve_max_model_len(requested_tokens=args.max_model_len)
    if not args.chunked_prefill:
        max_model_len = min(max_model_len, args.max_num_batched_tokens)
    ops = get_ops(name=args.attention_backend, device=device)
    model = load_model(model_dir=model_dir, ops=ops, dtype=dtype, device=device, config=config,
                       quantization=args.quantization, parallel=(layout, group))
    spec = KVCacheSpec(num_layers=config.num_hidden_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=config.head_dim, dtype=kv_dtype)
    num_blocks = args.num_kv_blocks or measure_num_kv_blocks(
        model=model, spec=spec, device=device, block_size=args.block_size,
        kv_memory_fraction=args.kv_memory_fraction, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
    agreed = min(group.all_gather_object(num_blocks))
    return RankModel(model=model, layout=layout, spec=spec, num_blocks=agreed,
                     max_model_len=max_model_len)


def serve_worker(args: ServeArgs, *, model_dir: Path, rank: int, size: int, init_method: str) -> None:
    """A worker rank's whole life: join, load, execute the driver's messages, leave."""
    from ..loading import resolve_device

    group = init_group(rank=rank, size=size, init_method=init_method,
                       device=rank_device(resolve_device(args.device), rank))
    loaded = load_rank(args, model_dir=model_dir, group=group)
    caches = allocate_kv_caches(spec=loaded.spec, num_blocks=loaded.num_blocks, block_size=args.block_size,
                                device=group.device)
    log.info("tensor-parallel rank %d ready: %d KV blocks", rank, loaded.num_blocks)
    model = loaded.model
    while True:
        try:
            message = control.receive(group)
        except RuntimeError as exc:  # the driver is gone (its connection closed)
            log.warning("tensor-parallel rank %d: the driver is gone (%s); exiting", rank, exc)
            return
        if isinstance(message, control.Step):
            inputs = message.rows.build(block_size=args.block_size, device=group.device)
            with torch.inference_mode():
                hidden = model.forward(input_ids=inputs.input_ids, positions=inputs.positions,
                                       kv_caches=caches, md=inputs.md)
                if inputs.logits_indices.numel():
                    model.compute_logits(hidden[inputs.logits_indices])  # the vocabulary gather
        elif isinstance(message, control.ReadBlocks):
            control.gather_blocks(group, loaded.layout, caches, message.block_ids)
        elif isinstance(message, control.WriteBlocks):
            control.write_blocks(loaded.layout, caches, message.blocks)
        else:
            break


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


def worker_argv(args: ServeArgs, *, model_dir: Path, rank: int, size: int, init_method: str) -> list[str]:
    """The command line :func:`main` parses."""
    return [sys.executable, "-m", __name__, "--rank", str(rank), "--size", str(size),
            "--init-method", init_method, "--model-dir", str(model_dir),
            "--serve-args", json.dumps(dataclasses.asdict(args))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a tensor-parallel worker rank (started by splitserve serve)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--serve-args", required=True, help="ServeArgs as JSON")
    ns = parser.parse_args(argv)
    exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{ns.rank} %(levelname)s %(name)s: %(message)s")
    args = ServeArgs(**json.loads(ns.serve_args))
    serve_worker(args, model_dir=ns.model_dir, rank=ns.rank, size=ns.size, init_method=ns.init_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
