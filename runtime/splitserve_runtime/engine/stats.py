"""A point-in-time snapshot of the engine's gauges and counters (docs/architecture.md, "Metrics").

The server exports these as the ``splitserve_*`` metrics; field names match the metric
names without prefix. Counters only grow for the engine's lifetime. :func:`engine_stats` reads
them off the engine's parts (scheduler, block manager, token outputs, speculation, step counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server imports this module for the type alone, without torch
    from .block_manager import BlockManager
    from .engine_request import TokenOutputs
    from .scheduler import Scheduler
    from .speculative import SpeculativeDecoder
    from .step_work import StepCounters


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    requests_waiting: int
    requests_running: int
    prompt_tokens_waiting: int
    """Prompt (and recompute) tokens of waiting requests not covered by the prefix cache."""
    kv_cache_usage_ratio: float
    """Blocks held by live requests / total; cached-but-free blocks count as free."""
    kv_cache_blocks_total: int
    kv_cache_blocks_cached: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queried_tokens_total: int
    prefix_cache_hit_tokens_total: int
    preemptions_total: int
    steps_total: int
    kv_cache_block_size: int = 0
    """Tokens per KV block (0: unknown)."""
    spec_decode_proposed_tokens_total: int = 0
    """Speculative proposals verified (``--speculative-method``)."""
    spec_decode_accepted_tokens_total: int = 0
    spec_decode_accepted_tokens_by_position: tuple[int, ...] = ()
    """Accepted proposals by their position (0: the first proposal of a sequence's step)."""
    spec_decode_proposed_tokens_by_position: tuple[int, ...] = ()
    """Verifications that proposed a token at each position: accepted / proposed at position i
    is that position's acceptance rate."""
    engine_steps_total: int = 0
    """Engine steps that ran (:mod:`.step_work`: the SLO autoscaler's step-model counters)."""
    engine_step_seconds_total: float = 0.0
    """Wall time spent inside those steps (busy time: scheduling, forward, sampling, outputs)."""
    engine_prefill_tokens_total: int = 0
    """New (uncached) prompt tokens computed, recompute after preemption included."""
    engine_prefill_attention_pairs_total: int = 0
    """Causal attention pairs of prefill chunks: ``n·c + n(n+1)/2`` per chunk."""
    engine_decode_rows_total: int = 0
    """Decoding sequences summed over steps (a speculative verification: 1 + proposals rows)."""
    engine_decode_context_tokens_total: int = 0
    """KV-cache tokens each decode row reads (the sequence's computed tokens), summed."""
    engine_decode_only_steps_total: int = 0
    """The part of ``engine_steps_total`` that computed no prefill chunk (decode-only steps)."""
    engine_decode_only_step_seconds_total: float = 0.0
    """Their part of ``engine_step_seconds_total``."""
    engine_decode_only_rows_total: int = 0
    """Their part of ``engine_decode_rows_total``."""
    engine_decode_only_context_tokens_total: int = 0
    """Their part of ``engine_decode_context_tokens_total``."""


def engine_stats(
    *,
    scheduler: Scheduler,
    block_manager: BlockManager,
    outputs: TokenOutputs,
    speculation: SpeculativeDecoder,
    steps_total: int,
    steps: StepCounters,
) -> EngineStats:
    """The snapshot of one engine now (``steps_total``: the model steps it ran)."""
    sched = scheduler
    bm = block_manager
    return EngineStats(
        requests_waiting=sched.num_waiting,
        requests_running=sched.num_running,
        prompt_tokens_waiting=sched.num_prompt_tokens_waiting(),
        kv_cache_usage_ratio=bm.usage_ratio,
        kv_cache_blocks_total=bm.num_blocks,
        kv_cache_blocks_cached=bm.num_cached_blocks,
        kv_cache_block_size=bm.block_size,
        prompt_tokens_total=outputs.prompt_tokens_total,
        generation_tokens_total=outputs.generation_tokens_total,
        prefix_cache_queried_tokens_total=sched.counters.prefix_cache_queried_tokens_total,
        prefix_cache_hit_tokens_total=sched.counters.prefix_cache_hit_tokens_total,
        preemptions_total=sched.counters.preemptions_total,
        steps_total=steps_total,
        spec_decode_proposed_tokens_total=speculation.proposed_total,
        spec_decode_accepted_tokens_total=speculation.accepted_total,
        spec_decode_accepted_tokens_by_position=tuple(speculation.accepted_by_position),
        spec_decode_proposed_tokens_by_position=tuple(speculation.proposed_by_position),
        engine_steps_total=steps.steps,
        engine_step_seconds_total=steps.seconds,
        engine_prefill_tokens_total=steps.prefill_tokens,
        engine_prefill_attention_pairs_total=steps.prefill_attention_pairs,
        engine_decode_rows_total=steps.decode_rows,
        engine_decode_context_tokens_total=steps.decode_context_tokens,
        engine_decode_only_steps_total=steps.decode_only_steps,
        engine_decode_only_step_seconds_total=steps.decode_only_seconds,
        engine_decode_only_rows_total=steps.decode_only_rows,
        engine_decode_only_context_tokens_total=steps.decode_only_context_tokens,
    )
