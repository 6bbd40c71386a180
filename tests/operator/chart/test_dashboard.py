"""The Grafana dashboard the chart ships (helm/splitserve/dashboards/splitserve.json).

Grafana itself is not available here, so the dashboard is checked as data: it is Grafana's
schema (unique panel ids, a gridPos each, rows, a ``datasource`` variable and the
``namespace``/``inferenceservice``/``pool`` variables every query uses), every metric it
names is one the contract defines (``splitserve_contract.metrics`` and each engine's series in
``splitserve_contract.engine_metrics``), every runtime query of a signal vLLM exports has a vLLM
arm (derived from the engine tables), the docs copy is the same file, and the chart renders it
into the sidecar's ConfigMap only when ``dashboards.enabled``.

Every query also runs through a real PromQL engine, ``promtool test rules`` (Debian's
``prometheus`` package, which ``.ci/deps`` installs), over synthetic scrapes shaped like the
runtime's, vLLM's (checked against a real vLLM ``/metrics`` page) and the operator's, once for a
bundled-runtime InferenceService and once for a vLLM one: each must parse and return a finite
value, and the variables must list either. The operator's series
carry ``namespace`` and ``inferenceservice`` labels of their own, which Prometheus renames to
``exported_*`` where its target labels clash (``honor_labels: false``); the operator panels
must find them under all three labellings seen in practice, and only the chosen service's.
The queries run against the e2e cluster's real Prometheus during load in
``e2e/test_dashboard_promql.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_chart import _helm, _render
from test_chart import needs_helm as _needs_helm

import splitserve_contract as contract
from splitserve_contract.engine_metrics import (
    ENGINE_METRICS,
    SIGNAL_KINDS,
    SPLITSERVE_METRICS,
    VLLM_METRICS,
    EngineMetricNames,
)
from splitserve_contract.engines import Engine
from splitserve_operator.autoscaler.decision import (
    PoolPolicy,
    RecommendationHistory,
    SignalValue,
    decide,
)
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics

REPO: Final = Path(__file__).resolve().parents[3]
CHART: Final = REPO / "helm" / "splitserve"
DASHBOARD_PATH: Final = CHART / "dashboards" / "splitserve.json"
DOCS_COPY: Final = REPO / "docs" / "grafana" / "splitserve-dashboard.json"
DASHBOARD: Final[dict[str, Any]] = json.loads(DASHBOARD_PATH.read_text())

VARIABLES: Final = ("datasource", "namespace", "inferenceservice", "pool")
GRAFANA_BUILTINS: Final = ("__rate_interval", "__interval", "__range")
VLLM_PAGE: Final = REPO / "tests" / "contract" / "fixtures" / "vllm-0.32.0-metrics.txt"
"""A real ``/metrics`` page of the pinned vLLM (what ``engine_metrics.VLLM_METRICS`` is checked against)."""
CONTRACT_METRICS: Final = frozenset(
    value for cls in (contract.Metric, contract.OperatorMetric) for key, value in vars(cls).items() if key.isupper()
)
RUNTIME_METRICS: Final = frozenset(value for key, value in vars(contract.Metric).items() if key.isupper())
OPERATOR_METRICS: Final = CONTRACT_METRICS - RUNTIME_METRICS


def signal_series(names: EngineMetricNames) -> dict[str, str]:
    """An engine's series name for each signal it exports (the fields ``SIGNAL_KINDS`` lists)."""
    out = {}
    for field in SIGNAL_KINDS:
        name = getattr(names, field)
        if name is not None:
            out[field] = str(name)
    return out


ENGINE_SERIES: Final = frozenset(name for names in ENGINE_METRICS.values() for name in signal_series(names).values())
SIGNAL_OF: Final = {name: field for names in ENGINE_METRICS.values() for field, name in signal_series(names).items()}
"""Each engine's series name to the signal it carries."""
DEFINED_METRICS: Final = CONTRACT_METRICS | ENGINE_SERIES
"""Every name a query may select: the contract's runtime and operator metrics, and each engine's
series for the signals (vLLM's ``vllm:*``)."""
HISTOGRAM_SUFFIXES: Final = ("_bucket", "_sum", "_count")
PANEL_METRICS: Final = frozenset(
    {
        contract.OperatorMetric.AUTOSCALER_DESIRED_REPLICAS,
        contract.OperatorMetric.AUTOSCALER_READY_REPLICAS,
        contract.OperatorMetric.AUTOSCALER_DECISIONS_TOTAL,
        contract.Metric.REQUESTS_WAITING,
        contract.Metric.KV_CACHE_USAGE_RATIO,
        contract.Metric.TIME_TO_FIRST_TOKEN_SECONDS,
        contract.Metric.INTER_TOKEN_LATENCY_SECONDS,
        contract.Metric.PROMPT_TOKENS_TOTAL,
        contract.Metric.GENERATION_TOKENS_TOTAL,
        contract.Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL,
        contract.Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
        contract.Metric.KV_TRANSFER_BYTES_TOTAL,
        contract.Metric.KV_TRANSFER_FAILURES_TOTAL,
    }
)
"""What issue 18 asks the dashboard to show: replicas desired/ready, autoscaler decisions, queue
depth, KV cache usage, TTFT and ITL, prompt and generation tokens, prefix cache hit rate, KV
transfer bytes and failures."""


needs_helm: pytest.MarkDecorator = _needs_helm  # typed: test_chart is not a package mypy resolves


# --------------------------------------------------------------------------- walking it
def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels") or []


def targets(dashboard: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in panels(dashboard):
        for target in panel.get("targets") or []:
            yield panel, target


def variable_queries(dashboard: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out[variable["name"]] = str(query["query"] if isinstance(query, dict) else query)
    return out


def variable_selector(query: str) -> tuple[str, str]:
    """``label_values(selector, label)``: the series selector and the label, as Grafana reads them."""
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
    assert match, query
    return match.group(1), match.group(2)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """``$name`` and ``${name}`` replaced from ``values``; an unknown variable is an error."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {text!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def metric_names(expr: str) -> set[str]:
    """splitserve and vLLM metric names an expression selects (histogram series names folded to
    the histogram's name)."""
    names = set()
    for name in re.findall(r"\bsplitserve_[a-z0-9_]+\b|\bvllm:[a-z0-9_:]+", expr):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in DEFINED_METRICS:
                name = name.removesuffix(suffix)
        names.add(name)
    return names


# --------------------------------------------------------------------------- shape
def test_docs_copy_is_the_charts_dashboard_byte_for_byte() -> None:
    assert DOCS_COPY.read_bytes() == DASHBOARD_PATH.read_bytes(), (
        f"cp {DASHBOARD_PATH.relative_to(REPO)} {DOCS_COPY.relative_to(REPO)}"
    )


def test_dashboard_is_grafana_schema_with_unique_ids_and_grid_positions() -> None:
    assert DASHBOARD["schemaVersion"] >= 39
    assert DASHBOARD["uid"] == "splitserve" and DASHBOARD["title"]
    assert "__inputs" not in DASHBOARD  # the sidecar provisions as is: no ${DS_...} to fill in
    ids = [p["id"] for p in panels(DASHBOARD)]
    assert len(ids) == len(set(ids)), ids
    boxes = []
    for panel in panels(DASHBOARD):
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        boxes.append((panel["title"], grid))
    for i, (title, a) in enumerate(boxes):
        for other, b in boxes[i + 1 :]:
            overlap = (
                a["x"] < b["x"] + b["w"]
                and b["x"] < a["x"] + a["w"]
                and a["y"] < b["y"] + b["h"]
                and b["y"] < a["y"] + a["h"]
            )
            assert not overlap, (title, other)
    rows = [p for p in panels(DASHBOARD) if p["type"] == "row"]
    assert [r.get("repeat") for r in rows] == [None, "pool"]


def test_every_panel_queries_prometheus_through_the_datasource_variable() -> None:
    graphs = [p for p in panels(DASHBOARD) if p["type"] != "row"]
    assert len(graphs) >= 12
    for panel in graphs:
        assert panel["title"] and panel.get("description"), panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), (panel["title"], target["refId"])
            assert target["datasource"] == panel["datasource"]


def test_variables_are_defined_and_every_reference_resolves() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert tuple(variables) == VARIABLES
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    queries = variable_queries(DASHBOARD)
    for name, label in (("namespace", "namespace"), ("inferenceservice", "inferenceservice"), ("pool", "role")):
        selector, listed = variable_selector(queries[name])
        assert listed == label, queries[name]
        # every engine's pods are listed: a vLLM-only service and its pools too (values: promtool below)
        for engine, names in ENGINE_METRICS.items():
            assert metric_names(selector) & set(signal_series(names).values()), (name, engine, queries[name])
    assert variables["pool"]["multi"] and variables["pool"]["includeAll"]
    values = dict.fromkeys((*VARIABLES, *GRAFANA_BUILTINS), "x")
    for panel in panels(DASHBOARD):
        substitute(panel["title"], values)
        for target in panel.get("targets") or []:
            substitute(target["expr"], values)
            substitute(target.get("legendFormat", ""), values)
    for query in queries.values():
        substitute(query, values)
    # each query, every arm of it, is scoped to the chosen service and pool
    for panel, target in targets(DASHBOARD):
        selectors = re.findall(r"\b(?:splitserve_[a-z0-9_]+|vllm:[a-z0-9_:]+)(\{[^}]*\})?", target["expr"])
        assert selectors, panel["title"]
        for matchers in selectors:
            assert '"$namespace"' in matchers and '"$inferenceservice"' in matchers, (panel["title"], matchers)
            assert '=~"$pool"' in matchers, (panel["title"], matchers)


def test_every_metric_is_one_the_contract_defines() -> None:
    used: set[str] = set()
    for _, target in targets(DASHBOARD):
        used |= metric_names(target["expr"])
    for query in variable_queries(DASHBOARD).values():
        used |= metric_names(query)
    assert used - DEFINED_METRICS == set(), "not in splitserve_contract/metrics.py nor engine_metrics.py"
    assert PANEL_METRICS - used == set(), "issue 18's panels"
    assert {name for name in used if name.startswith("vllm:")}, "no vLLM series at all"


def test_metric_name_check_catches_an_unknown_name() -> None:
    names = metric_names(
        "histogram_quantile(0.9, rate(splitserve_time_to_first_token_seconds_bucket[1m])) + splitserve_queue_lenght"
        " or histogram_quantile(0.9, rate(vllm:time_to_first_token_seconds_bucket[1m]))"
        ' + vllm:num_requests_waitng{engine="0"} + rate(vllm:inter_token_latency_secnds_bucket[1m])'
    )
    assert names == {
        contract.Metric.TIME_TO_FIRST_TOKEN_SECONDS,
        "splitserve_queue_lenght",
        VLLM_METRICS.time_to_first_token_seconds,
        "vllm:num_requests_waitng",
        "vllm:inter_token_latency_secnds_bucket",
    }
    assert names - DEFINED_METRICS == {
        "splitserve_queue_lenght",
        "vllm:num_requests_waitng",
        "vllm:inter_token_latency_secnds_bucket",
    }


def test_every_query_of_a_signal_vllm_exports_has_a_vllm_arm() -> None:
    """From the engine tables: wherever a query selects the bundled runtime's series for a signal
    vLLM also exports, the same query selects vLLM's (the ``or`` arm a vLLM pool's line comes
    from); and the dashboard shows every signal vLLM exports."""
    runtime, vllm = signal_series(SPLITSERVE_METRICS), signal_series(VLLM_METRICS)
    missing: list[tuple[str, str, str]] = []
    shown: set[str] = set()
    for panel, target in targets(DASHBOARD):
        used = metric_names(target["expr"])
        for field, name in runtime.items():
            if name in used and field in vllm:
                shown.add(field)
                if vllm[field] not in used:
                    missing.append((f"{panel['title']} {target['refId']}", name, vllm[field]))
    assert missing == [], "add an `or` arm with the vLLM series"
    assert shown == set(vllm), "signals vLLM exports that no panel shows"


def test_runtime_panels_without_a_vllm_arm_say_vllm_does_not_export_it() -> None:
    """A panel of the bundled runtime's series only (KV hand-off, prompt tokens waiting) is empty
    for a vLLM pool: its description says so."""
    quiet = []
    for panel in panels(DASHBOARD):
        used = {name for target in panel.get("targets") or [] for name in metric_names(target["expr"])}
        if used & RUNTIME_METRICS and not any(name.startswith("vllm:") for name in used):
            assert "vLLM pools do not export" in panel["description"], panel["title"]
            quiet.append(panel["title"])
    assert quiet, "no runtime-only panel: drop this test"


# --------------------------------------------------------------------------- the chart
@needs_helm
def test_configmap_renders_only_when_enabled_with_the_sidecar_label() -> None:
    assert [d for d in _render() if d["kind"] == "ConfigMap"] == []
    docs = _render("dashboards.enabled=true")
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["metadata"]["name"] == "rel-splitserve-dashboards"
    assert configmap["metadata"]["namespace"] == "ops"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert "annotations" not in configmap["metadata"]
    assert configmap["data"] == {"splitserve.json": DASHBOARD_PATH.read_text()}


@needs_helm
def test_configmap_namespace_labels_and_annotations_are_values() -> None:
    docs = _render(
        "dashboards.enabled=true",
        "dashboards.namespace=monitoring",
        "dashboards.labels.team=llm",
        "dashboards.annotations.grafana_folder=LLM",
    )
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    meta = configmap["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["team"] == "llm" and meta["labels"]["grafana_dashboard"] == "1"
    assert meta["annotations"] == {"grafana_folder": "LLM"}


@needs_helm
def test_chart_lints_with_the_dashboard_and_refuses_a_bad_value() -> None:
    lint = _helm("lint", "--strict", str(CHART), "--set", "dashboards.enabled=true")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    bad = _helm("template", "rel", str(CHART), "--set", "dashboards.enabeld=true")
    assert bad.returncode != 0 and "dashboards" in bad.stderr, bad.stderr


def test_values_document_the_dashboard_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["dashboards"] == {
        "enabled": False,
        "namespace": "",
        "labels": {"grafana_dashboard": "1"},
        "annotations": {},
    }
    readme = (CHART / "README.md").read_text()
    assert "dashboards.enabled" in readme


# --------------------------------------------------------------------------- the operator's series
def test_autoscaler_exports_desired_and_ready_replicas_per_pool() -> None:
    registry = CollectorRegistry()
    metrics = AutoscalerMetrics.create(registry=registry)
    decision = decide(
        pool="decode",
        now_seconds=0.0,
        current_replicas=3,
        ready_replicas=2,
        pending_replicas=1,
        signals={"queue": SignalValue(value=1.0, target=4.0)},
        policy=PoolPolicy(min_replicas=1, max_replicas=4),
        history=RecommendationHistory(),
        gpus_per_replica=1,
    )
    metrics.observe(namespace="team", name="chat", decision=decision)
    labels = {"namespace": "team", "inferenceservice": "chat", "role": "decode"}
    assert registry.get_sample_value(contract.OperatorMetric.AUTOSCALER_READY_REPLICAS, labels) == 2
    assert registry.get_sample_value(contract.OperatorMetric.AUTOSCALER_DESIRED_REPLICAS, labels) == decision.result
    metrics.forget(namespace="team", name="chat")
    assert registry.get_sample_value(contract.OperatorMetric.AUTOSCALER_READY_REPLICAS, labels) is None


# --------------------------------------------------------------------------- a real PromQL engine
NS, ISVC, OTHER, OPERATOR_NS, RELEASE = "team", "chat", "other", "ops", "splitserve"
VLLM_ISVC: Final = "vchat"
TARGET_LABELS: Final = ("namespace", "inferenceservice", "pod", "role", "job", "instance")
"""What the harness's scrape adds to every pod's series, whichever engine (role from the pod's label)."""
VLLM_FINISHED_REASONS: Final = ("stop", "length", "abort")
VLLM_BUCKETS: Final = ("0.5", "1.0", "5.0", "+Inf")
"""``le`` values that vLLM 0.32's TTFT, inter-token and e2e latency histograms all have."""
PROMTOOL_VALUES: Final = {
    "datasource": "prometheus",
    "namespace": NS,
    "inferenceservice": ISVC,
    "pool": "(prefill|decode)",
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}
OPERATOR_LABELLINGS: Final[Mapping[str, Mapping[str, str]]] = {
    # the e2e harness: one pod job adds namespace and inferenceservice (the release) itself
    "harness": {
        "namespace": OPERATOR_NS,
        "inferenceservice": RELEASE,
        "exported_namespace": "{ns}",
        "exported_inferenceservice": "{isvc}",
    },
    # a PodMonitor/ServiceMonitor without honorLabels: only namespace clashes
    "monitor": {"namespace": OPERATOR_NS, "exported_namespace": "{ns}", "inferenceservice": "{isvc}"},
    # honorLabels (the chart's monitors): the operator's labels as exported
    "honored": {"namespace": "{ns}", "inferenceservice": "{isvc}"},
}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not on PATH: install Debian's `prometheus` package (.ci/deps does)")
    return found


def _series(name: str, labels: Mapping[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _parse_series(series: str) -> tuple[str, dict[str, str]]:
    match = re.fullmatch(r"([^{]+)\{(.*)\}", series)
    assert match, series
    return match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))


def _histogram(
    name: str, labels: Mapping[str, str], les: tuple[str, ...] = ("0.05", "0.5", "5", "+Inf")
) -> list[dict[str, str]]:
    steps = (1, 4, 6, 6)
    assert len(les) == len(steps) and les[-1] == "+Inf"
    out = [
        {"series": _series(f"{name}_bucket", {**labels, "le": le}), "values": f"0+{step}x20"}
        for le, step in zip(les, steps, strict=True)
    ]
    out += [
        {"series": _series(f"{name}_count", labels), "values": "0+6x20"},
        {"series": _series(f"{name}_sum", labels), "values": "0+3x20"},
    ]
    return out


def _runtime_series(*, isvc: str) -> list[dict[str, str]]:
    """Both pools' pods as the e2e harness's Prometheus labels them (target labels namespace,
    pod, inferenceservice; the runtime's own role, model)."""
    out: list[dict[str, str]] = []
    for role in ("prefill", "decode"):
        labels = {
            "namespace": NS,
            "inferenceservice": isvc,
            "pod": f"{isvc}-{role}-0",
            "role": role,
            "model": "tiny",
            "job": "splitserve-pods",
            "instance": f"10.0.0.{len(out)}:8000",
        }
        for name in (
            contract.Metric.REQUESTS_WAITING,
            contract.Metric.REQUESTS_RUNNING,
            contract.Metric.PROMPT_TOKENS_WAITING,
            contract.Metric.KV_CACHE_BLOCKS,
        ):
            out.append({"series": _series(name, labels), "values": "3x20"})
        out.append({"series": _series(contract.Metric.KV_CACHE_USAGE_RATIO, labels), "values": "0.25x20"})
        for name in (
            contract.Metric.PROMPT_TOKENS_TOTAL,
            contract.Metric.GENERATION_TOKENS_TOTAL,
            contract.Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
            contract.Metric.KV_TRANSFER_BYTES_TOTAL,
        ):
            out.append({"series": _series(name, labels), "values": "0+100x20"})
        for name in (contract.Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL, contract.Metric.PREEMPTIONS_TOTAL):
            out.append({"series": _series(name, labels), "values": "0+25x20"})
        out.append({"series": _series(contract.Metric.KV_TRANSFER_FAILURES_TOTAL, labels), "values": "0x20"})
        for outcome in contract.OUTCOMES:
            out.append(
                {
                    "series": _series(contract.Metric.REQUESTS_TOTAL, {**labels, "outcome": outcome}),
                    "values": "0+6x20" if outcome == "success" else "0x20",
                }
            )
        for name in (
            contract.Metric.TIME_TO_FIRST_TOKEN_SECONDS,
            contract.Metric.INTER_TOKEN_LATENCY_SECONDS,
            contract.Metric.E2E_REQUEST_LATENCY_SECONDS,
            contract.Metric.KV_TRANSFER_SECONDS,
        ):
            out += _histogram(name, labels)
    return out


def _vllm_series(*, isvc: str) -> list[dict[str, str]]:
    """An Aggregated vLLM InferenceService's two pods as the harness labels them: vLLM's own
    ``model_name`` and ``engine`` (the engine core's index; the second pod runs two, as with
    data parallelism), the target labels, and ``role`` from the pod's label (vLLM has none)."""
    out: list[dict[str, str]] = []
    role = contract.Role.AGGREGATED.value
    for index, engines in enumerate((("0",), ("0", "1"))):
        for engine in engines:
            labels = {
                "namespace": NS,
                "inferenceservice": isvc,
                "pod": f"{isvc}-{role}-{index}",
                "role": role,
                "job": "splitserve-pods",
                "instance": f"10.0.1.{index}:8000",
                "model_name": "smollm2",
                "engine": engine,
            }
            for name in (VLLM_METRICS.requests_waiting, VLLM_METRICS.requests_running):
                out.append({"series": _series(name, labels), "values": "3x20"})
            out.append({"series": _series(VLLM_METRICS.kv_cache_usage_ratio, labels), "values": "0.25x20"})
            for name in (
                VLLM_METRICS.prompt_tokens_total,
                VLLM_METRICS.generation_tokens_total,
                VLLM_METRICS.prefix_cache_queried_tokens_total,
            ):
                out.append({"series": _series(name, labels), "values": "0+100x20"})
            for name in (VLLM_METRICS.prefix_cache_hit_tokens_total, VLLM_METRICS.preemptions_total):
                out.append({"series": _series(name, labels), "values": "0+25x20"})
            for reason in VLLM_FINISHED_REASONS:
                out.append(
                    {
                        "series": _series(
                            VLLM_METRICS.requests_total, {**labels, VLLM_METRICS.requests_outcome_label: reason}
                        ),
                        "values": "0+6x20" if reason == "stop" else "0+1x20",
                    }
                )
            for name in (
                VLLM_METRICS.time_to_first_token_seconds,
                VLLM_METRICS.inter_token_latency_seconds,
                VLLM_METRICS.e2e_request_latency_seconds,
            ):
                out += _histogram(name, labels, VLLM_BUCKETS)
    return out


def _operator_series(
    labelling: Mapping[str, str], *, isvc: str, desired: int, roles: tuple[str, ...] = ("prefill", "decode")
) -> list[dict[str, str]]:
    target = {"pod": "splitserve-abc", "job": "splitserve-pods", "instance": "10.0.0.9:8080"}
    labels = {**target, **{k: v.format(ns=NS, isvc=isvc) for k, v in labelling.items()}}
    out = []
    for role in roles:
        with_role = {**labels, "role": role}
        out.append(
            {
                "series": _series(contract.OperatorMetric.AUTOSCALER_DESIRED_REPLICAS, with_role),
                "values": f"{desired}x20",
            }
        )
        out.append(
            {
                "series": _series(contract.OperatorMetric.AUTOSCALER_READY_REPLICAS, with_role),
                "values": f"{desired - 1}x20",
            }
        )
        out.append(
            {
                "series": _series(
                    contract.OperatorMetric.AUTOSCALER_DECISIONS_TOTAL, {**with_role, "direction": "none"}
                ),
                "values": "0+1x20",
            }
        )
    return out


POD_SCRAPES: Final[Mapping[Engine, tuple[str, Callable[..., list[dict[str, str]]]]]] = {
    Engine.SPLITSERVE: (ISVC, _runtime_series),
    Engine.VLLM: (VLLM_ISVC, _vllm_series),
}
"""Per engine: the InferenceService the promtool scenario chooses, and its pods' scrapes."""


def _pods_by_role(series: list[dict[str, str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for row in series:
        _, labels = _parse_series(row["series"])
        out.setdefault(labels["role"], set()).add(labels["pod"])
    return out


def _outcomes_by_role(series: list[dict[str, str]], engine: Engine) -> set[tuple[str, str]]:
    names = ENGINE_METRICS[engine]
    out = set()
    for row in series:
        name, labels = _parse_series(row["series"])
        if name == names.requests_total:
            out.add((labels["role"], labels[names.requests_outcome_label]))
    return out


def _record_name(panel: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    return f"dashboard:panel_{panel['id']}_{target['refId']}"


def _run_promtool(
    tmp_path: Path, tests: list[dict[str, Any]], values: Mapping[str, str] = PROMTOOL_VALUES
) -> subprocess.CompletedProcess[str]:
    rules = [
        {"record": _record_name(panel, target), "expr": substitute(target["expr"], values)}
        for panel, target in targets(DASHBOARD)
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    (tmp_path / "test.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    return subprocess.run(
        [_promtool(), "test", "rules", str(tmp_path / "test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_vllm_series_are_shaped_like_a_real_vllm_page() -> None:
    """Each synthetic vLLM series, less the scrape's target labels, is a sample of the pinned
    vLLM's real ``/metrics`` page (its name, label names, ``le`` and ``finished_reason``); and
    the scrape carries every signal vLLM exports."""
    real = set()
    for family in text_string_to_metric_families(VLLM_PAGE.read_text()):
        for sample in family.samples:
            fixed = frozenset((k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name"))
            real.add((sample.name, frozenset(sample.labels), fixed))
    names = set()
    for row in _vllm_series(isvc=VLLM_ISVC):
        name, labels = _parse_series(row["series"])
        assert set(TARGET_LABELS) <= set(labels), row
        own = {k: v for k, v in labels.items() if k not in TARGET_LABELS}
        fixed = frozenset((k, v) for k, v in own.items() if k not in ("engine", "model_name"))
        assert (name, frozenset(own), fixed) in real, row
        names.add(name)
    assert set(signal_series(VLLM_METRICS).values()) <= {metric_names(name).pop() for name in names}


@pytest.mark.parametrize("engine", list(Engine))
def test_every_query_parses_and_returns_finite_values_in_promql(tmp_path: Path, engine: Engine) -> None:
    """Each target recorded as a rule over the chosen service's synthetic scrapes (a bundled
    runtime's Disaggregated service, or a vLLM Aggregated one, with the other engine's service
    beside it), under every operator labelling: ``absent()`` of the recorded series is empty (it
    returned data) and ``x != x`` is empty (no NaN). A vLLM service's lines come only from the
    queries' vLLM arms. Also: the variables' selectors list both services and the chosen one's
    pools; the pods-reporting line counts each pod once (a vLLM pod with two engine cores
    included); the outcome line carries ``outcome`` (vLLM's ``finished_reason``)."""
    isvc, scrape = POD_SCRAPES[engine]
    pods = scrape(isvc=isvc)
    beside = [
        row for other, (name, other_scrape) in POD_SCRAPES.items() if other != engine for row in other_scrape(isvc=name)
    ]
    roles = _pods_by_role(pods)
    values = {**PROMTOOL_VALUES, "inferenceservice": isvc, "pool": "(" + "|".join(sorted(roles)) + ")"}
    scraped = {name for row in pods for name in metric_names(_parse_series(row["series"])[0])}
    exported = set(signal_series(ENGINE_METRICS[engine]))
    checks: list[dict[str, Any]] = []
    for panel, target in targets(DASHBOARD):
        name = _record_name(panel, target)
        # a line from the operator's series, the engine's, or any engine's series of a signal this
        # engine exports (so a missing arm is no line: a failure); none from another service's pods
        used = metric_names(target["expr"])
        shows = bool(used & (scraped | OPERATOR_METRICS)) or bool({SIGNAL_OF.get(n) for n in used} & exported)
        checks += [
            {
                "expr": f"absent({name})",
                "eval_time": "15m",
                "exp_samples": [] if shows else [{"labels": "{}", "value": 1}],
            },
            {"expr": f"{name} != {name}", "eval_time": "15m", "exp_samples": []},
        ]
    listed = {"namespace": {NS}, "inferenceservice": {name for name, _ in POD_SCRAPES.values()}, "pool": set(roles)}
    for variable, query in variable_queries(DASHBOARD).items():
        selector, label = variable_selector(substitute(query, values))
        checks.append(
            {
                "expr": f"group by ({label}) ({selector})",
                "eval_time": "15m",
                "exp_samples": [{"labels": f'{{{label}="{value}"}}', "value": 1} for value in sorted(listed[variable])],
            }
        )
    (replicas,) = [p for p in panels(DASHBOARD) if p["title"] == "Replicas"]
    (reporting,) = [t for t in replicas["targets"] if contract.Metric.KV_CACHE_BLOCKS in t["expr"]]
    checks.append(
        {
            "expr": _record_name(replicas, reporting),
            "eval_time": "15m",
            "exp_samples": [
                {"labels": f'{_record_name(replicas, reporting)}{{role="{role}"}}', "value": len(names)}
                for role, names in sorted(roles.items())
            ],
        }
    )
    ((outcomes_panel, outcomes),) = [
        (p, t) for p, t in targets(DASHBOARD) if contract.Metric.REQUESTS_TOTAL in metric_names(t["expr"])
    ]
    assert "{{outcome}}" in outcomes["legendFormat"]
    checks.append(
        {
            "expr": f"count by (role, outcome) ({_record_name(outcomes_panel, outcomes)})",
            "eval_time": "15m",
            "exp_samples": [
                {"labels": f'{{outcome="{outcome}", role="{role}"}}', "value": 1}
                for role, outcome in sorted(_outcomes_by_role(pods, engine))
            ],
        }
    )
    tests = [
        {
            "name": f"{engine} {labelling}",
            "interval": "1m",
            "input_series": [*pods, *beside, *_operator_series(labels, isvc=isvc, desired=3, roles=tuple(roles))],
            "promql_expr_test": checks,
        }
        for labelling, labels in OPERATOR_LABELLINGS.items()
    ]
    result = _run_promtool(tmp_path, tests, values)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "SUCCESS" in result.stdout


def test_operator_panels_find_the_chosen_service_under_every_labelling(tmp_path: Path) -> None:
    """The replicas panel's desired and ready lines: the chosen service's values, never the
    other service's, however Prometheus labelled the operator's series."""
    (replicas,) = [p for p in panels(DASHBOARD) if p["title"] == "Replicas"]
    desired, ready = (
        t
        for t in replicas["targets"]
        if contract.OperatorMetric.AUTOSCALER_DESIRED_REPLICAS in t["expr"]
        or contract.OperatorMetric.AUTOSCALER_READY_REPLICAS in t["expr"]
    )
    tests = []
    for labelling, labels in OPERATOR_LABELLINGS.items():
        tests.append(
            {
                "name": labelling,
                "interval": "1m",
                "input_series": [
                    *_operator_series(labels, isvc=ISVC, desired=3),
                    *_operator_series(labels, isvc=OTHER, desired=7),
                ],
                "promql_expr_test": [
                    {
                        "expr": _record_name(replicas, target),
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": f'{_record_name(replicas, target)}{{role="{role}"}}', "value": value}
                            for role in ("prefill", "decode")
                        ],
                    }
                    for target, value in ((desired, 3), (ready, 2))
                ],
            }
        )
    result = _run_promtool(tmp_path, tests)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
