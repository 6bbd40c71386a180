"""Asynchronous scheduling's overlap: milliseconds per engine step with the host's per-step
work (detokenizing, stop checks) done after the forward, and overlapped with the next one.

The engine's spec tests show that asynchronous scheduling gives the same tokens, outputs and
counters as synchronous steps (``tests/runtime/engine/test_engine_step_bookkeeping.py``); whether it
*hides* the host's work is a speed figure, so it is measured here, not asserted there. The
model is the null model with a forward that sleeps ``--forward-ms`` (a stand-in for a GPU
forward the host does not wait on), and each request's detokenizer sleeps ``--host-ms`` per
token (host work that grows with the batch). Sleeps on both sides: other load hardly moves the
figures. Synchronous steps cost about forward + batch x host; overlapped, about the larger of
the two.

    python bench/async_scheduling.py [--requests 8] [--host-ms 3] [--forward-ms 25] [--steps 8]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.stop_checker import Detokenizer

VOCAB = 1024


class SlowLetters:
    """Token t is the letter ``chr(97 + t % 8)``, after ``delay_s`` of host work."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def step(self, token_id: int) -> str:
        time.sleep(self.delay_s)
        return chr(97 + token_id % 8)

    def flush(self) -> str:
        return ""


def _detokenizer(prompt: list[int], *, delay_s: float) -> Detokenizer:
    return SlowLetters(delay_s)


def seconds_per_step(*, overlapped: bool, requests: int, host_s: float, forward_s: float, steps: int) -> float:
    model = NullModel(vocab_size=VOCAB, forward_seconds=forward_s)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    config = EngineConfig(
        max_model_len=256,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        async_scheduling=overlapped,
    )
    engine = LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=VOCAB,
        config=config,
        device=torch.device("cpu"),
        detokenizer_factory=partial(_detokenizer, delay_s=host_s),
    )
    try:
        for i in range(requests):
            engine.add_request(
                request_id=f"r{i}",
                prompt_token_ids=[i + 1, i + 2],
                params=SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True),
            )
        engine.step()  # the prefill, then the first decode step: the pipeline is full after these
        engine.step()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - started) / steps
    finally:
        while engine.has_unfinished():
            engine.step()
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--host-ms", type=float, default=3.0)
    parser.add_argument("--forward-ms", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    figures = {
        overlapped: seconds_per_step(
            overlapped=overlapped,
            requests=args.requests,
            host_s=args.host_ms / 1000,
            forward_s=args.forward_ms / 1000,
            steps=args.steps,
        )
        for overlapped in (False, True)
    }
    print(f"{args.requests} requests, host work {args.host_ms:g} ms per token, forward {args.forward_ms:g} ms")
    print(f"  synchronous : {figures[False] * 1000:7.1f} ms/step")
    print(f"  overlapped  : {figures[True] * 1000:7.1f} ms/step   ({figures[True] / figures[False]:.2f} x)")


if __name__ == "__main__":
    main()
