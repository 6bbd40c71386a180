"""Disaggregated serving with quantized weights and an FP8 KV cache, as real processes: the
fp8 blocks cross the KV transfer as stored, so the answers equal the aggregated engine's with
the same settings; a decode pod whose KV dtype differs from the prefill pod's refuses the
blocks (a layout mismatch, counted) and computes the prompt itself, with the same answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from disagg_harness import MODEL_NAME, Cluster, Reference

from splitserve_contract import Metric

QUANTIZED = {"quantization": "int4", "kv_cache_dtype": "fp8"}
PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)


@pytest.fixture(scope="module")
def quantized_reference(model_dir: Path) -> Reference:
    return Reference(model_dir=model_dir, **QUANTIZED)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefill and one decode pod, both int4 weights and fp8 KV."""
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=1,
        num_decode=1,
        prefill_overrides=QUANTIZED,
        decode_overrides=QUANTIZED,
    ) as running:
        yield running


def _client(cluster: Cluster) -> openai.OpenAI:
    assert cluster.router is not None
    return openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_int4_weights_and_fp8_kv_disaggregated_equal_aggregated(
    cluster: Cluster, quantized_reference: Reference
) -> None:
    want_text, _ = quantized_reference.generate(
        quantized_reference.tokenizer.encode(PROMPT), max_tokens=16, ignore_eos=True
    )
    received = sum(p.metric(Metric.KV_TRANSFER_BYTES_TOTAL) for p in cluster.decode)
    answer = _client(cluster).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want_text
    assert sum(p.metric(Metric.KV_TRANSFER_BYTES_TOTAL) for p in cluster.decode) > received


def test_a_decode_pod_with_another_kv_dtype_refuses_the_blocks_and_computes(model_dir: Path, tmp_path: Path) -> None:
    """A prefill pod with fp8 KV and a decode pod with full-precision KV (a misconfiguration the
    operator's compat hash prevents, and this harness on purpose does not): the decode pod
    refuses the blocks as a layout mismatch naming the dtypes, and still answers."""
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path,
        num_prefill=1,
        num_decode=1,
        prefill_overrides=QUANTIZED,
        decode_overrides={"quantization": "int4"},
    ) as mixed:
        decode = mixed.decode[0]
        failures = decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL)
        answer = _client(mixed).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
        assert "float8_e4m3fn" in decode.log_path.read_text(errors="replace")
