"""``LLMEngine``: the synchronous engine core — add requests, step, collect outputs.

One :meth:`LLMEngine.step` = schedule (:mod:`.scheduler`) → run the model and sample
(:mod:`.model_runner`) → append tokens, check stop conditions (:mod:`.stop_checker`) and
emit one :class:`~.outputs.RequestOutput` delta per request that produced something. The
engine is single-threaded by design; :mod:`.async_engine` drives it from a background
thread for the server.

:meth:`LLMEngine.from_args` builds the whole stack from ``ServeArgs``: model URI → config,
tokenizer and weights, device and dtype resolution, KV pool measurement.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..contract import ENV_MODEL_CACHE, ServeArgs
from .block_manager import BlockManager
from .config import EngineConfig
from .errors import ContextLengthExceeded, DuplicateRequestId, PromptExceedsKVCapacity
from .kv_budget import KVCacheSpec
from .model_runner import CausalLM, ModelRunner, measure_num_kv_blocks
from .outputs import FINISH_ABORT, FINISH_LENGTH, RequestOutput, TokenLogprob
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence
from .stats import EngineStats
from .stop_checker import DetokenizerFactory, StopChecker

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    seq: Sequence
    stop: StopChecker
    prompt_counted: bool = False


class LLMEngine:
    """Synchronous engine; not thread-safe (one thread calls every method)."""

    def __init__(self, *, model: CausalLM, kv_spec: KVCacheSpec, vocab_size: int,
                 config: EngineConfig, device: torch.device,
                 eos_token_ids: Iterable[int] = (),
                 detokenizer_factory: DetokenizerFactory | None = None,
                 model_name: str = "", tokenizer: object | None = None) -> None:
        self.config = config
        self.device = device
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._detokenizer_factory = detokenizer_factory
        torch.manual_seed(config.seed)
        num_blocks = config.num_kv_blocks or measure_num_kv_blocks(
            model=model, spec=kv_spec, device=device, block_size=config.block_size,
            kv_memory_fraction=config.kv_memory_fraction,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len)
        self.block_manager = BlockManager(num_blocks=num_blocks, block_size=config.block_size,
                                          enable_prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(
            config=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   chunked_prefill=config.chunked_prefill),
            block_manager=self.block_manager)
        self.runner = ModelRunner(model=model, spec=kv_spec, device=device,
                                  block_size=config.block_size, num_blocks=num_blocks,
                                  eos_token_ids=self.eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._steps_total = 0
        log.info("engine ready: %d KV blocks of %d tokens on %s", num_blocks, config.block_size, device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_args(cls, args: ServeArgs) -> LLMEngine:
        """Resolve the model URI and build model, tokenizer and engine from ``args``."""
        from ..model.config import load_model_config
        from ..model.loader import load_model
        from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
        from ..model.uri import resolve_model_uri
        from ..ops import get_ops

        if args.quantization != "none":
            raise ValueError(f"quantization {args.quantization!r} is not supported by this engine yet")
        if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
            raise ValueError("tensor/pipeline parallelism > 1 is not supported by this engine yet")
        device = resolve_device(args.device)
        model_dir = resolve_model_uri(args.model, cache_dir=_model_cache_dir(), revision=args.revision)
        model_config = load_model_config(model_dir=model_dir)
        dtype = resolve_dtype(args.dtype, device=device, config_dtype=model_config.torch_dtype)
        max_model_len = model_config.resolve_max_model_len(requested_tokens=args.max_model_len)
        if not args.chunked_prefill and args.max_num_batched_tokens < max_model_len:
            log.warning("chunked prefill is off: max_model_len lowered from %d to "
                        "max_num_batched_tokens=%d", max_model_len, args.max_num_batched_tokens)
            max_model_len = args.max_num_batched_tokens
        ops = get_ops(name=args.attention_backend, device=device)
        tokenizer = Tokenizer.from_dir(model_dir=model_dir)
        model = load_model(model_dir=model_dir, ops=ops, dtype=dtype, device=device,
                           config=model_config)
        spec = KVCacheSpec(num_layers=model_config.num_hidden_layers,
                           num_kv_heads=model_config.num_key_value_heads,
                           head_dim=model_config.head_dim, dtype=dtype)
        eos = set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids)

        def detokenizer(prompt_token_ids: list[int]) -> IncrementalDetokenizer:
            return IncrementalDetokenizer(tokenizer=tokenizer, context_token_ids=prompt_token_ids)

        return cls(model=model, kv_spec=spec, vocab_size=model_config.vocab_size,
                   config=EngineConfig.from_serve_args(args, max_model_len=max_model_len),
                   device=device, eos_token_ids=eos, detokenizer_factory=detokenizer,
                   model_name=args.served_model_name or args.model, tokenizer=tokenizer)

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def check_request(self, *, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admission checks that need no engine state (safe from any thread)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        if not all(type(t) is int for t in prompt_token_ids):
            bad = next(t for t in prompt_token_ids if type(t) is not int)
            raise ValueError(f"prompt token ids must be integers, got {bad!r}")
        low, high = min(prompt_token_ids), max(prompt_token_ids)
        if low < 0 or high >= self.vocab_size:
            bad_id = low if low < 0 else high
            raise ValueError(f"prompt token id {bad_id} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self._detokenizer_factory is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        if num_prompt + params.max_tokens > self.config.max_model_len:
            raise ContextLengthExceeded(num_prompt_tokens=num_prompt, max_tokens=params.max_tokens,
                                        max_model_len=self.config.max_model_len)
        bm = self.block_manager
        needed = bm.num_blocks_for(num_prompt)
        if needed > bm.num_blocks:
            raise PromptExceedsKVCapacity(num_prompt_tokens=num_prompt, num_blocks_needed=needed,
                                          num_blocks_total=bm.num_blocks, block_size=bm.block_size)

    def add_request(self, *, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time_s: float | None = None) -> None:
        if request_id in self._requests:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
        self.check_request(prompt_token_ids=prompt_token_ids, params=params)
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), params=params,
                       arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s)
        detok = self._detokenizer_factory(list(prompt_token_ids)) if self._detokenizer_factory else None
        self._requests[request_id] = _RequestState(
            seq=seq, stop=StopChecker(params=params, eos_token_ids=self.eos_token_ids, detokenizer=detok))
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; returns its final output (None if unknown)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        self.runner.sampler.release(request_id)
        return self._output(state, new_token_ids=[], new_logprobs=None, finish_reason=FINISH_ABORT,
                            now=time.monotonic(), ttft=None, itl=[])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for seq in sched.finished:  # could never fit in the KV cache
            state = self._requests.pop(seq.request_id)
            self.runner.sampler.release(seq.request_id)
            outputs.append(self._output(state, new_token_ids=[], new_logprobs=None,
                                        finish_reason=seq.finish_reason, now=now, ttft=None, itl=[]))
        if sched.is_empty:
            return outputs
        sampled_seqs, result = self.runner.execute(sched)
        self.scheduler.on_step_done(sched)
        self._steps_total += 1
        now = time.monotonic()
        for seq, token_id, logprob in zip(sampled_seqs, result.token_ids, result.logprobs, strict=True):
            outputs.append(self._append_token(seq=seq, token_id=token_id, logprob=logprob, now=now))
        return outputs

    def _append_token(self, *, seq: Sequence, token_id: int, logprob: TokenLogprob | None,
                      now: float) -> RequestOutput:
        state = self._requests[seq.request_id]
        if not state.prompt_counted:
            state.prompt_counted = True
            self._prompt_tokens_total += seq.num_prompt_tokens
        seq.token_ids.append(token_id)
        self._generation_tokens_total += 1
        ttft: float | None = None
        itl: list[float] = []
        if seq.first_token_time_s is None:
            seq.first_token_time_s = now
            ttft = now - seq.arrival_time_s
        elif seq.last_token_time_s is not None:
            itl = [now - seq.last_token_time_s]
        seq.last_token_time_s = now
        reason = state.stop.append(token_id=token_id, num_output_tokens=seq.num_output_tokens)
        if reason is None and seq.num_tokens >= self.config.max_model_len:
            reason = FINISH_LENGTH
            state.stop.flush()
        if reason is not None:
            self.scheduler.finish(seq, reason=reason)
            self.runner.sampler.release(seq.request_id)
            del self._requests[seq.request_id]
        return self._output(state, new_token_ids=[token_id],
                            new_logprobs=None if logprob is None else [logprob],
                            finish_reason=reason, now=now, ttft=ttft, itl=itl)

    def _output(self, state: _RequestState, *, new_token_ids: list[int],
                new_logprobs: list[TokenLogprob] | None, finish_reason: str | None, now: float,
                ttft: float | None, itl: list[float]) -> RequestOutput:
        seq = state.seq
        finished = finish_reason is not None
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_token_ids,
            new_text=state.stop.take_new_text(finished=finished), new_logprobs=new_logprobs,
            finished=finished, finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, ttft_seconds=ttft, itl_seconds=itl,
            e2e_seconds=(now - seq.arrival_time_s) if finished else None)

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        sched = self.scheduler
        bm = self.block_manager
        return EngineStats(
            requests_waiting=sched.num_waiting, requests_running=sched.num_running,
            prompt_tokens_waiting=sched.num_prompt_tokens_waiting(),
            kv_cache_usage_ratio=bm.usage_ratio, kv_cache_blocks_total=bm.num_blocks,
            kv_cache_blocks_cached=bm.num_cached_blocks,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queried_tokens_total=sched.counters.prefix_cache_queried_tokens_total,
            prefix_cache_hit_tokens_total=sched.counters.prefix_cache_hit_tokens_total,
            preemptions_total=sched.counters.preemptions_total, steps_total=self._steps_total)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"unknown device {name!r}; choose auto, cuda or cpu")
    return torch.device(name)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, *, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if config_dtype in ("bfloat16", "float16"):
        return _DTYPES[config_dtype]
    return torch.bfloat16


def _model_cache_dir() -> Path | None:
    value = os.environ.get(ENV_MODEL_CACHE)
    return Path(value) if value else None
