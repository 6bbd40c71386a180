"""The engine-step counters (``splitserve_engine_*_total``) count exactly the work of known requests.

They are the SLO autoscaler's regression features (:mod:`splitserve_runtime.engine.step_work`),
so the counts are checked against the request shapes, derived by hand from the scheduler's
rules: whole prompts, chunked prompts, prefix-cache hits, an imported (decode-pod) request,
asynchronous scheduling and speculative verification rows; then that the server exports them.
The engine is the compute-free :class:`~splitserve_runtime.engine.null_model.NullModel`, so the
counts are deterministic and the test takes well under a second.
"""

from __future__ import annotations

import torch
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import Metric
from splitserve_runtime.engine.config import EngineConfig
from splitserve_runtime.engine.kv_budget import KVCacheSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.null_model import NullModel, build_null_engine, null_next_token
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.speculative import SpeculativeConfig
from splitserve_runtime.engine.stats import EngineStats
from splitserve_runtime.server.metrics import ServerMetrics

VOCAB = 1024


def _config(**overrides: object) -> EngineConfig:
    values: dict[str, object] = {
        "max_model_len": 256,
        "block_size": 4,
        "num_kv_blocks": 128,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "prefix_caching": False,
    }
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(start: int, length: int) -> list[int]:
    return [(start + 17 * i) % (VOCAB - 1) + 1 for i in range(length)]


def _drain(engine: LLMEngine) -> None:
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def _work(stats: EngineStats) -> tuple[int, int, int, int, int]:
    return (
        stats.engine_steps_total,
        stats.engine_prefill_tokens_total,
        stats.engine_prefill_attention_pairs_total,
        stats.engine_decode_rows_total,
        stats.engine_decode_context_tokens_total,
    )


def _pairs(new: int, computed: int) -> int:
    return new * computed + new * (new + 1) // 2


def test_whole_prompts_then_decodes_count_exactly() -> None:
    """Two prompts (10 and 6 tokens) prefilled together, then decoded: step 1 computes both
    prompts and samples each one's first token; each later step decodes every sequence still
    running, each row reading its computed tokens."""
    engine = build_null_engine(config=_config())
    shapes = {"a": (10, 4), "b": (6, 2)}  # prompt tokens, output tokens
    for rid, (prompt, output) in shapes.items():
        engine.add_request(request_id=rid, prompt_token_ids=_prompt(len(rid), prompt), params=_params(output))
    _drain(engine)
    prefill_tokens = sum(p for p, _ in shapes.values())
    pairs = sum(_pairs(p, 0) for p, _ in shapes.values())
    rows = sum(o - 1 for _, o in shapes.values())
    context = sum(p + i for p, o in shapes.values() for i in range(o - 1))  # 10+11+12, 6
    steps = max(o for _, o in shapes.values())
    stats = engine.stats()
    assert _work(stats) == (steps, prefill_tokens, pairs, rows, context) == (4, 16, 76, 4, 39)
    assert stats.engine_steps_total == stats.steps_total
    assert stats.engine_step_seconds_total > 0.0


def _decode_only(stats: EngineStats) -> tuple[int, int, int]:
    return (
        stats.engine_decode_only_steps_total,
        stats.engine_decode_only_rows_total,
        stats.engine_decode_only_context_tokens_total,
    )


def test_decode_only_part_counts_the_steps_without_a_prefill_chunk() -> None:
    """``a`` (4-token prompt, 5 tokens) prefills alone, decodes once alone, then shares a step
    with ``b``'s 6-token prompt (a mixed step: its decode row is in the totals, not in the
    decode-only part), then both decode until ``b``'s 2 tokens are done and ``a`` goes on."""
    engine = build_null_engine(config=_config())
    engine.add_request(request_id="a", prompt_token_ids=_prompt(1, 4), params=_params(5))
    engine.step()  # a's prefill
    engine.step()  # a decodes alone (context 4)
    assert _decode_only(engine.stats()) == (1, 1, 4)
    engine.add_request(request_id="b", prompt_token_ids=_prompt(2, 6), params=_params(2))
    engine.step()  # mixed: b's prefill, a's decode (context 5)
    mixed = engine.stats()
    assert _decode_only(mixed) == (1, 1, 4)
    assert _work(mixed) == (3, 10, _pairs(4, 0) + _pairs(6, 0), 2, 4 + 5)
    _drain(engine)  # a: context 6, 7 (with b's context 6), done
    stats = engine.stats()
    assert _work(stats) == (5, 10, 31, 5, 4 + 5 + 6 + 6 + 7)
    assert _decode_only(stats) == (3, 4, 4 + 6 + 6 + 7)
    assert 0.0 < stats.engine_decode_only_step_seconds_total < stats.engine_step_seconds_total


def test_chunked_prefill_pairs_add_up_to_the_whole_prompt() -> None:
    """A 20-token prompt under an 8-token budget runs as chunks of 8, 8 and 4 after 0, 8 and
    16 computed tokens: n·c + n(n+1)/2 per chunk sums to the unchunked 20·21/2."""
    engine = build_null_engine(config=_config(max_num_batched_tokens=8))
    engine.add_request(request_id="long", prompt_token_ids=_prompt(3, 20), params=_params(3))
    _drain(engine)
    chunks = [(8, 0), (8, 8), (4, 16)]
    assert sum(_pairs(n, c) for n, c in chunks) == _pairs(20, 0) == 210
    assert _work(engine.stats()) == (len(chunks) + 2, 20, 210, 2, 20 + 21)


def test_prefix_cache_hits_are_not_computed_but_are_attended_to() -> None:
    """The second request shares 12 of its 16 prompt tokens (3 blocks of 4) with the first:
    only its last 4 tokens are computed, as one chunk after 12 cached ones."""
    engine = build_null_engine(config=_config(prefix_caching=True))
    first = _prompt(5, 16)
    engine.add_request(request_id="first", prompt_token_ids=first, params=_params(1))
    _drain(engine)
    before = _work(engine.stats())
    assert before == (1, 16, _pairs(16, 0), 0, 0)
    second = first[:12] + _prompt(900, 4)
    engine.add_request(request_id="second", prompt_token_ids=second, params=_params(2))
    _drain(engine)
    after = _work(engine.stats())
    delta = tuple(a - b for a, b in zip(after, before, strict=True))
    assert engine.stats().prefix_cache_hit_tokens_total == 12
    assert delta == (2, 4, _pairs(4, 12), 1, 16)


def test_imported_request_on_a_decode_pod_counts_decode_rows_only() -> None:
    """A decode pod's request arrives with its prompt's KV: no prefill is computed there, and
    its first decode row reads the 8 imported tokens."""
    engine = build_null_engine(config=_config())
    prompt = _prompt(7, 8)
    first_token = null_next_token(prompt[-1], vocab_size=VOCAB)
    reservation = engine.reserve_imported_request(
        request_id="moved",
        token_ids=prompt + [first_token],
        num_prompt_tokens=len(prompt),
        params=_params(4),
        num_imported_tokens=len(prompt),
    )
    assert reservation is not None
    engine.activate_imported_request("moved")
    _drain(engine)
    # the first output token came from the prefill pod: 3 decode steps here over 8, 9, 10 tokens
    assert _work(engine.stats()) == (3, 0, 0, 3, 8 + 9 + 10)


def test_asynchronous_scheduling_counts_the_same_prefill_work_and_every_step_it_ran() -> None:
    shapes = {"a": (10, 5), "b": (6, 3), "c": (30, 2)}
    counts = {}
    for async_scheduling in (False, True):
        engine = build_null_engine(config=_config(async_scheduling=async_scheduling))
        for rid, (prompt, output) in shapes.items():
            engine.add_request(request_id=rid, prompt_token_ids=_prompt(len(rid) * 3, prompt), params=_params(output))
        _drain(engine)
        counts[async_scheduling] = _work(engine.stats())
        assert engine.stats().engine_steps_total >= engine.stats().steps_total
    sync, overlapped = counts[False], counts[True]
    assert overlapped[1:3] == sync[1:3]  # prefill tokens and pairs
    # a request that step n ends computes one dropped row in step n+1: at most one per request
    assert sync[3] <= overlapped[3] <= sync[3] + len(shapes)
    assert sync[4] <= overlapped[4]


def test_speculative_verification_rows_count_as_decode_rows() -> None:
    """With n-gram speculation every verified proposal is one more decode row: rows are the
    decoding sequences per step plus the proposals. Prompts that repeat the start of the
    model's own chain make proposals: accepted ones, and a rejected one where the prompt
    broke the chain."""
    model = NullModel(vocab_size=VOCAB)
    spec = KVCacheSpec(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype
    )
    engine = LLMEngine(
        model=model,
        kv_spec=spec,
        vocab_size=VOCAB,
        config=_config(),
        device=torch.device("cpu"),
        model_name="null",
        speculative=SpeculativeConfig(method="ngram", num_tokens=3),
    )
    chain = [11]
    for _ in range(11):
        chain.append(null_next_token(chain[-1], vocab_size=VOCAB))
    assert 999 not in chain
    prompts = {"accepted": chain[:8] + chain[:4], "rejected": chain[:6] + [999] + chain[:3]}
    for rid, prompt in prompts.items():
        engine.add_request(request_id=rid, prompt_token_ids=prompt, params=_params(16))
    _drain(engine)
    stats = engine.stats()
    assert stats.preemptions_total == 0
    assert 0 < stats.spec_decode_accepted_tokens_total < stats.spec_decode_proposed_tokens_total
    # every request's first token comes from its prefill; each other token is a decode's own
    # row or an accepted proposal
    decode_sequence_steps = stats.generation_tokens_total - len(prompts) - stats.spec_decode_accepted_tokens_total
    assert stats.engine_decode_rows_total == decode_sequence_steps + stats.spec_decode_proposed_tokens_total
    assert stats.engine_steps_total == stats.steps_total
    assert stats.engine_prefill_tokens_total == sum(len(p) for p in prompts.values())


def test_busy_time_is_counted_and_idle_time_is_not() -> None:
    forward = 0.01
    engine = build_null_engine(config=_config(), forward_seconds=forward)
    engine.add_request(request_id="r", prompt_token_ids=_prompt(1, 8), params=_params(3))
    _drain(engine)
    stats = engine.stats()
    assert stats.engine_steps_total == 3
    assert stats.engine_step_seconds_total >= 3 * forward  # each step sleeps in its forward
    for _ in range(5):
        engine.step()  # nothing to do: neither a step nor time
    assert engine.stats().engine_steps_total == 3
    assert engine.stats().engine_step_seconds_total == stats.engine_step_seconds_total


def test_server_exports_the_counters_as_prometheus_counters() -> None:
    engine = build_null_engine(config=_config())
    engine.add_request(request_id="r", prompt_token_ids=_prompt(2, 12), params=_params(3))
    _drain(engine)
    stats = engine.stats()
    metrics = ServerMetrics(role="aggregated", model="null", stats_source=engine.stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    expected = {
        Metric.ENGINE_STEPS_TOTAL: stats.engine_steps_total,
        Metric.ENGINE_STEP_SECONDS_TOTAL: stats.engine_step_seconds_total,
        Metric.ENGINE_PREFILL_TOKENS_TOTAL: 12,
        Metric.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL: _pairs(12, 0),
        Metric.ENGINE_DECODE_ROWS_TOTAL: 2,
        Metric.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL: 12 + 13,
        Metric.ENGINE_DECODE_ONLY_STEPS_TOTAL: 2,
        Metric.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL: stats.engine_decode_only_step_seconds_total,
        Metric.ENGINE_DECODE_ONLY_ROWS_TOTAL: 2,
        Metric.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL: 12 + 13,
    }
    for name, value in expected.items():
        family = families[name.removesuffix("_total")]  # the parser names a counter's family without it
        assert family.type == "counter", name
        (sample,) = [s for s in family.samples if s.name == name]
        assert sample.labels == {"role": "aggregated", "model": "null"}
        assert sample.value == float(value), name
