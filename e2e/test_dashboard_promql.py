"""The chart's Grafana dashboard against the cluster's real Prometheus, under load.

Grafana itself cannot run here, so this does what Grafana would: it reads
``helm/splitserve/dashboards/splitserve.json``, fills in the template variables (the
namespace, the InferenceService, each pool; ``$__rate_interval`` as 10 s, ten of this
cluster's 1-second scrapes) and sends every panel query to Prometheus's HTTP API as a range
query over the window of a load, as the panels would, and the variables' ``label_values``
queries to the label API. Every query must parse and return at least one series; every panel
must show a number in at least one pool (an inter-token latency on a prefill pool, which makes
one token per request, is legitimately NaN), and the panels that measure the load must show it.

The setup is the one the other modules use (:func:`~splitserve_e2e.stack.operator_namespace`:
the chart's operator as a container, reading this Prometheus), a Disaggregated tiny
InferenceService (one pod per pool, autoscaling on, so the operator's decision and replica
series exist) and a :class:`~splitserve_e2e.demo.LoadBurst` through its router. The table of
panel → pool → series → peak value is printed (``-s``).

(Named ``test_dashboard_promql`` because ``tests/operator/chart/test_dashboard.py``, the dashboard's
unit tests, has the plain name: pytest needs distinct basenames across the two trees.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import LoadBurst, apply_object, router_endpoints, wait_ready
from splitserve_e2e.prometheus import PrometheusQueryError
from splitserve_e2e.stack import ModelHub, isvc_manifest, operator_namespace

pytestmark = pytest.mark.e2e

REPO: Final = Path(__file__).resolve().parents[1]
DASHBOARD: Final[dict[str, Any]] = json.loads(
    (REPO / "helm" / "splitserve" / "dashboards" / "splitserve.json").read_text()
)
NAME: Final = "dash"
POOLS: Final = (contract.Role.PREFILL.value, contract.Role.DECODE.value)
ALL_POOLS: Final = f"({'|'.join(POOLS)})"
"""What Grafana sends for a multi-value variable set to All: a regex alternation."""
LOAD_SECONDS: Final = 20.0
RATE_INTERVAL: Final = "10s"
STEP_SECONDS: Final = 2.0
MEASURES_THE_LOAD: Final = frozenset(
    {
        "Replicas",
        "Autoscaler decisions",
        "Requests / s by outcome",
        "Tokens / s",
        "Time to first token",
        "End-to-end request latency",
        "KV transfer bytes / s",
    }
)
"""Panels whose every line must rise above zero in every pool this load goes through."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    namespace: str
    start: float
    end: float
    load: LoadBurst


@dataclasses.dataclass(frozen=True)
class Answer:
    panel: str
    legend: str
    pool: str
    series: int
    peak: float  # the largest finite value over every series and step; NaN when none


# --------------------------------------------------------------------------- Grafana's part
def _panels_with_pools() -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """Every graph panel with the pool values Grafana queries it for: once per pool below a
    row repeated over ``pool``, else once with All."""
    pools: tuple[str, ...] = (ALL_POOLS,)
    for panel in DASHBOARD["panels"]:
        if panel["type"] == "row":
            pools = POOLS if panel.get("repeat") == "pool" else (ALL_POOLS,)
            for inner in panel.get("panels") or []:
                yield inner, pools
            continue
        yield panel, pools


def _substitute(text: str, values: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {text!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def _values(namespace: str, pool: str) -> dict[str, str]:
    return {
        "namespace": namespace,
        "inferenceservice": NAME,
        "pool": pool,
        "__rate_interval": RATE_INTERVAL,
        "__interval": f"{STEP_SECONDS:g}s",
    }


# --------------------------------------------------------------------------- Prometheus's part
def _api(url: str, path: str, params: Mapping[str, Any]) -> Any:
    body = httpx.get(f"{url}{path}", params=params, timeout=30.0).json()
    if body.get("status") != "success":
        raise PrometheusQueryError(f"{path} {dict(params)}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def _peak(result: list[dict[str, Any]]) -> float:
    finite = [float(v) for series in result for _, v in series["values"] if math.isfinite(float(v))]
    return max(finite) if finite else math.nan


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def loaded(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[Loaded]:
    """A Disaggregated InferenceService after a bounded load that Prometheus has scraped past."""
    url = cluster.prometheus_url
    if not url:
        pytest.fail("the dashboard e2e test needs the cluster's Prometheus")
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="e2e-dashboard") as ns:
        # one pod per pool (min = max): the autoscaler decides every interval, scales nothing
        apply_object(
            cluster=cluster,
            obj=isvc_manifest(name=NAME, namespace=ns, mode="Disaggregated", hub=model_hub, max_replicas=1),
        )
        wait_ready(cluster=cluster, namespace=ns, name=NAME, timeout_seconds=300)
        endpoint = router_endpoints(cluster=cluster, namespace=ns, name=NAME)[0]
        load = LoadBurst(
            base_url=f"http://{endpoint}/v1",
            concurrency=4,
            duration_seconds=LOAD_SECONDS,
            prompt_words=60,
            max_tokens=16,
        )
        start = time.time()
        asyncio.run(load.run())
        end = time.time()
        interval = cluster.options.scrape_interval_seconds
        selector = f'namespace="{ns}", inferenceservice="{NAME}"'

        def scraped_past_the_load() -> bool:
            newest = _api(
                url, "/api/v1/query", {"query": f"min(timestamp({contract.Metric.REQUESTS_TOTAL}{{{selector}}}))"}
            )["result"]
            return bool(newest) and float(newest[0]["value"][1]) >= end + 2 * interval

        cluster.wait_for(
            scraped_past_the_load,
            timeout_seconds=60,
            interval_seconds=0.5,
            what="two scrapes of every runtime pod after the load",
        )
        yield Loaded(namespace=ns, start=start, end=end + 2 * interval, load=load)


# --------------------------------------------------------------------------- tests
def test_the_load_went_through(loaded: Loaded) -> None:
    assert loaded.load.ok >= 10, loaded.load.errors()[:5]


def test_variables_list_the_service_and_both_pools(cluster: LocalCluster, loaded: Loaded) -> None:
    """Each ``label_values(selector, label)`` as Grafana runs it: the label values API."""
    assert cluster.prometheus_url
    expected = {"namespace": {loaded.namespace}, "inferenceservice": {NAME}, "pool": set(POOLS)}
    queries = {v["name"]: v["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"}
    assert set(queries) == set(expected)
    for name, query in queries.items():
        text = _substitute(query["query"] if isinstance(query, dict) else query, _values(loaded.namespace, ALL_POOLS))
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", text)
        assert match, text
        values = _api(
            cluster.prometheus_url,
            f"/api/v1/label/{match.group(2)}/values",
            {"match[]": match.group(1), "start": loaded.start, "end": loaded.end},
        )
        assert expected[name] <= set(values), (name, text, values)


def test_every_panel_query_returns_data_over_the_load(cluster: LocalCluster, loaded: Loaded) -> None:
    url = cluster.prometheus_url
    assert url
    answers: list[Answer] = []
    errors: list[str] = []
    for panel, pools in _panels_with_pools():
        for target in panel["targets"]:
            for pool in pools:
                expr = _substitute(target["expr"], _values(loaded.namespace, pool))
                try:
                    result = _api(
                        url,
                        "/api/v1/query_range",
                        {"query": expr, "start": loaded.start, "end": loaded.end, "step": STEP_SECONDS},
                    )["result"]
                except PrometheusQueryError as error:
                    errors.append(str(error))
                    continue
                answers.append(
                    Answer(
                        panel=panel["title"],
                        legend=target.get("legendFormat", ""),
                        pool=pool,
                        series=len(result),
                        peak=_peak(result),
                    )
                )
    labelled = _api(
        url,
        "/api/v1/series",
        {"match[]": contract.OperatorMetric.AUTOSCALER_DESIRED_REPLICAS, "start": loaded.start, "end": loaded.end},
    )
    print(f"\noperator series as scraped: {labelled[:1]}")
    print(f"{'panel':<28} {'line':<24} {'pool':<18} {'series':>6} {'peak':>12}")
    for a in answers:
        print(f"{a.panel:<28} {a.legend:<24} {a.pool:<18} {a.series:>6} {a.peak:>12.4g}")
    assert errors == []
    assert len({a.panel for a in answers}) == sum(1 for _ in _panels_with_pools())
    assert [a for a in answers if a.series == 0] == []
    by_line: dict[tuple[str, str], list[Answer]] = {}
    for a in answers:
        by_line.setdefault((a.panel, a.legend), []).append(a)
    assert [line for line, found in by_line.items() if all(math.isnan(a.peak) for a in found)] == []
    flat = [a for a in answers if a.panel in MEASURES_THE_LOAD and not a.peak > 0]
    assert flat == [], "panels that must show the load"
    assert {a.panel for a in answers} >= MEASURES_THE_LOAD
