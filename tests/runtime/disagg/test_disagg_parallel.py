"""Heterogeneous disaggregation as real processes: a prefill pod at tensor parallelism 2 and a
decode pod at 1, the other way round, and a two-stage pipeline prefilling for a TP 2 decode
pod. The KV moves rank to rank (each decode rank pulls the layers and KV heads it owns from the
prefill ranks holding them, at the ports those ranks listen on), so the answers equal the
aggregated single-process engine's and the blocks really moved (test_kv_rank_pull.py checks
which ranks connect to which and how many bytes each receives)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from disagg_harness import MODEL_NAME, Cluster, Reference

from splitserve_contract import Metric

PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)


TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [(TP2, {}), ({}, TP2), (PP2, TP2)],
    ids=["tp2-prefill-tp1-decode", "tp1-prefill-tp2-decode", "pp2-prefill-tp2-decode"],
)
def test_prefill_and_decode_at_different_parallel_layouts_equal_aggregated(
    model_dir: Path, reference: Reference, tmp_path: Path, prefill: dict[str, int], decode: dict[str, int]
) -> None:
    want_text, _ = reference.generate(reference.tokenizer.encode(PROMPT), max_tokens=16, ignore_eos=True)
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path,
        num_prefill=1,
        num_decode=1,
        prefill_overrides=prefill,
        decode_overrides=decode,
    ) as cluster:
        assert cluster.router is not None
        client = openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.choices[0].text == want_text
        pod = cluster.decode[0]
        assert pod.metric(Metric.KV_TRANSFER_BYTES_TOTAL) > 0
        assert pod.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == 0
