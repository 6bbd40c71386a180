"""The runtime's /metrics passes `promtool check metrics` and follows the naming rules.

`splitserve_kv_cache_blocks_total` used to be a gauge with a counter's suffix, which promtool
flags and which makes PromQL users reach for rate() on it. The check runs on a real server's
scrape (tiny Llama on CPU) after one request, so the histograms and counters carry samples.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, InProcessServer, serve_args, start_server

from splitserve_contract import Metric, ModelServerMetric

COUNTER_ONLY_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
"""(prometheus_client's own `<counter>_created` gauges are the standard created timestamps.)"""


def _promtool() -> str | None:
    found = shutil.which("promtool")
    if found:
        return found
    cache = Path.home() / ".cache" / "splitserve" / "bin"
    for candidate in sorted(cache.glob("prometheus-*/**/promtool")):
        if candidate.is_file():
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def scrape(tiny_llama_dir: Path) -> Iterator[str]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir, max_model_len=512, num_kv_blocks=16)) as srv:
        _one_request(srv)
        yield httpx.get(f"{srv.base_url}/metrics", timeout=10).text


def _one_request(srv: InProcessServer) -> None:
    answer = httpx.post(
        f"{srv.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "count me", "max_tokens": 3, "temperature": 0},
    )
    assert answer.status_code == 200, answer.text


def test_contract_gauge_name_has_no_counter_suffix() -> None:
    assert Metric.KV_CACHE_BLOCKS == "splitserve_kv_cache_blocks"
    assert not hasattr(Metric, "KV_CACHE_BLOCKS_TOTAL")


def test_kv_cache_blocks_is_exported_under_the_gauge_name(scrape: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    assert families[Metric.KV_CACHE_BLOCKS].type == "gauge"
    assert "splitserve_kv_cache_blocks_total" not in scrape


def test_types_match_suffixes(scrape: str) -> None:
    """Gauges never end like a counter or histogram series; every counter ends in _total."""
    types: dict[str, str] = {}
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    assert types, "no # TYPE lines in the scrape"
    for name, kind in types.items():
        if kind == "gauge":
            assert not name.endswith(COUNTER_ONLY_SUFFIXES), f"gauge {name} has a counter suffix"
        if kind == "counter":
            assert name.endswith("_total"), f"counter {name} lacks _total"


def test_promtool_check_metrics(scrape: str) -> None:
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool not found (PATH or ~/.cache/splitserve/bin/prometheus-*)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=60, check=False
    )
    # the model-server protocol's names are vLLM's, colons included (pickers read them as they
    # are); promtool's only complaint may be about those
    protocol = {
        ModelServerMetric.NUM_REQUESTS_WAITING,
        ModelServerMetric.NUM_REQUESTS_RUNNING,
        ModelServerMetric.KV_CACHE_USAGE_PERC,
        ModelServerMetric.CACHE_CONFIG_INFO,
    }
    complaints = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not (line.split()[0] in protocol and "should not contain ':'" in line)
    ]
    assert not complaints, "promtool check metrics:\n" + "\n".join(complaints)
    assert result.returncode == 0 or (result.stdout + result.stderr).strip(), result


def test_model_server_protocol_gauges_mirror_ours(scrape: str) -> None:
    """Gateway API Inference Extension pickers read vLLM's gauge names: the same values as ours."""
    samples = {
        (s.name, s.labels.get("model_name")): s for f in text_string_to_metric_families(scrape) for s in f.samples
    }
    ours = {s.name: s.value for f in text_string_to_metric_families(scrape) for s in f.samples}
    for theirs, mine in (
        (ModelServerMetric.NUM_REQUESTS_WAITING, Metric.REQUESTS_WAITING),
        (ModelServerMetric.NUM_REQUESTS_RUNNING, Metric.REQUESTS_RUNNING),
        (ModelServerMetric.KV_CACHE_USAGE_PERC, Metric.KV_CACHE_USAGE_RATIO),
    ):
        assert samples[(theirs, MODEL_NAME)].value == ours[mine], theirs
    info = samples[(ModelServerMetric.CACHE_CONFIG_INFO, MODEL_NAME)]
    assert info.value == 1.0
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "16"


def test_the_engine_table_names_what_the_runtime_exports(scrape: str) -> None:
    """The bundled runtime's row of :mod:`splitserve_contract.engine_metrics`: every signal's
    series is here, of its type, labelled with the model (``tests/contract`` checks vLLM's)."""
    from splitserve_contract.engine_metrics import SIGNAL_KINDS, SPLITSERVE_METRICS

    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    for signal, kind in SIGNAL_KINDS.items():
        series = getattr(SPLITSERVE_METRICS, signal)
        family = families[series.removesuffix("_total") if kind == "counter" else series]
        assert family.type == kind, (signal, family.type)
        assert any(SPLITSERVE_METRICS.model_label in s.labels for s in family.samples), signal
