"""One definition of each shared fact: the block hash, reasons and defaults.

The engine's prefix cache, the router's prefix affinity and the planner name a block of
tokens with the same function; the API's defaults, the runtime's flag defaults and the
router's come from ``splitserve_contract.defaults``.
"""

from __future__ import annotations

from splitserve_contract import RouterArgs, ServeArgs, block_hash, defaults
from splitserve_contract.reasons import Reason
from splitserve_operator import api
from splitserve_runtime.router.policy import prefix_block_hashes


def test_router_and_engine_name_blocks_identically() -> None:
    tokens = list(range(100, 170))
    engine_side = block_hash.hash_token_blocks(token_ids=tokens, block_size=16)
    router_side = prefix_block_hashes(tokens, block_size=16)
    assert len(engine_side) == 4 and router_side == engine_side
    assert prefix_block_hashes(tokens, block_size=16, max_blocks=2) == engine_side[:2]


def test_engine_prefix_cache_uses_the_contract_hash() -> None:
    from splitserve_runtime.engine.block_manager import BlockManager
    from splitserve_runtime.engine.sampling_params import SamplingParams
    from splitserve_runtime.engine.sequence import Sequence

    tokens = list(range(1, 40))
    manager = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=True)
    seq = Sequence(request_id="r", token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams())
    assert manager.block_hashes_of(seq) == block_hash.hash_token_blocks(token_ids=tokens, block_size=16)


def test_defaults_agree_across_api_runtime_and_router() -> None:
    spec = api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "hf://a/b"}, "mode": "Aggregated", "aggregated": {}}
    )
    assert spec.kv_cache.block_size == ServeArgs().block_size == RouterArgs().block_size == defaults.BLOCK_SIZE
    assert spec.kv_cache.memory_fraction == ServeArgs().kv_memory_fraction == defaults.KV_MEMORY_FRACTION
    assert spec.scheduling_settings.max_num_seqs == ServeArgs().max_num_seqs == defaults.MAX_NUM_SEQS
    assert spec.autoscaling.interval == defaults.AUTOSCALING_INTERVAL


def test_api_reasons_are_the_contract_reasons() -> None:
    assert api.Reason is Reason
    names = [n for n in vars(Reason) if n.isupper()]
    values = [getattr(Reason, n) for n in names]
    assert len(set(values)) == len(values), "two reason names share one value"
    assert all(v[0].isupper() and v.isalnum() for v in values)


def test_speculative_defaults_and_bounds_agree_across_api_flags_and_engine() -> None:
    import pytest

    from splitserve_contract import capabilities as caps
    from splitserve_runtime.engine import speculative as engine_speculative

    spec = api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "hf://a/b"}, "mode": "Aggregated", "aggregated": {}}
    ).scheduling_settings.speculative
    serve = ServeArgs()
    engine = engine_speculative.SpeculativeConfig()
    assert spec.method == serve.speculative_method == engine.method == "none"
    assert spec.num_tokens == serve.num_speculative_tokens == engine.num_tokens
    assert spec.max_num_seqs == serve.speculative_max_num_seqs == engine.max_num_seqs
    # what the API admits, the engine serves: the supported methods and the largest numTokens
    assert set(caps.SPECULATIVE_METHOD.supported) == set(engine_speculative.METHODS)
    engine_speculative.SpeculativeConfig(method="ngram", num_tokens=api.MAX_SPECULATIVE_TOKENS)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_speculative.SpeculativeConfig(method="ngram", num_tokens=api.MAX_SPECULATIVE_TOKENS + 1)


def test_every_metric_name_is_documented() -> None:
    from pathlib import Path

    from splitserve_contract import Metric, OperatorMetric

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    names = [value for cls in (Metric, OperatorMetric) for key, value in vars(cls).items() if key.isupper()]
    assert len(names) > 20
    assert [name for name in names if f"`{name}" not in doc] == []
