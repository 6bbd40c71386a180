"""Rank 0's side of starting a parallel engine (tensor and/or pipeline): workers, group,
this rank's part of the model, engine.

The order matters: the workers are started first (they join the group, then load their shards
while rank 0 loads its own), every rank measures the KV cache in lock-step and takes the
smallest block count, and only then is the engine built, with a runner that drives the other
ranks. If rank 0 fails on the way, the workers are stopped with it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from pathlib import Path

import torch

from splitserve_contract import ServeArgs
from splitserve_contract.capabilities import UnsupportedError
from splitserve_contract.model_config import ModelConfig

from ..config import EngineConfig
from ..llm_engine import LLMEngine
from .group import init_group
from .launcher import free_init_method, start_workers
from .runner import ParallelRunner
from .worker import load_rank, rank_device


def parallel_engine(args: ServeArgs, *, model_dir: Path, model_config: ModelConfig,
                    device: torch.device) -> LLMEngine:
    """An engine whose model runs on ``tensor × pipeline`` ranks (this process is rank 0)."""
    from ...model.pipeline import PipelineStage
    from ...model.tensor_parallel import check_divisible
    from ..loading import text_settings

    if args.speculative_method == "draft":
        raise UnsupportedError("speculative decoding with a draft model is not supported with tensor or "
                               "pipeline parallelism yet (ngram is)")
    check_divisible(model_config, args.tensor_parallel_size)
    PipelineStage(config=model_config, stage=0, num_stages=args.pipeline_parallel_size)  # fits the layers
    init_method = free_init_method()
    workers = start_workers(args, model_dir=model_dir, init_method=init_method)
    try:
        group = init_group(rank=0, tp_size=args.tensor_parallel_size, num_stages=args.pipeline_parallel_size,
                           init_method=init_method, device=rank_device(device, 0))
        loaded = load_rank(args, model_dir=model_dir, group=group)
        config = EngineConfig.from_serve_args(dataclasses.replace(args, num_kv_blocks=loaded.num_blocks),
                                              max_model_len=loaded.max_model_len)
        engine = LLMEngine(model=loaded.model, kv_spec=loaded.spec, vocab_size=model_config.vocab_size,
                           config=config, device=group.device,
                           **text_settings(args, model_dir=model_dir, model_config=model_config),
                           runner_factory=functools.partial(ParallelRunner, group=group, loaded=loaded,
                                                            workers=workers))
    except BaseException:
        workers.kill()
        raise
    runner = engine.runner
    assert isinstance(runner, ParallelRunner)
    engine.on_close.append(runner.close)
    atexit.register(workers.kill)  # a process that ends without close() leaves no worker behind
    return engine
