"""The chart's Prometheus Operator objects (monitoring.*): off by default; the PodMonitors and
ServiceMonitors select exactly the pods and Services the operator renders (checked against
:func:`~splitserve_operator.render.render_children`, not against a copy of its labels) and the
operator's own pod and Service; the two monitor kinds refuse each other; the PrometheusRule's
rules name only metrics of the contract, pass ``promtool check rules``, and pass ``promtool
test rules`` (tests/operator/chart/fixtures/prometheus-rules.test.yaml: every alert fires on bad
series and stays silent on good ones), which in turn fails when a rule is changed.

Needs helm (found as tests/operator/chart/test_chart.py finds it) and promtool: Prometheus 3's once
the e2e harness has built it, else Debian's (the ``prometheus`` package, which .ci/deps
installs); ``$SPLITSERVE_PROMTOOL`` names another.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import _find_helm

import splitserve_contract as contract
from splitserve_contract import Metric, OperatorMetric
from splitserve_operator.api import InferenceService
from splitserve_operator.render import render_children
from splitserve_runtime.server import metrics as runtime_metrics

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "splitserve"
RULES_TEST = Path(__file__).resolve().parent / "fixtures" / "prometheus-rules.test.yaml"
NAMESPACE = "ops"
RELEASE = "rel"
FULLNAME = "rel-splitserve"
MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
POD_MONITOR = "monitoring.podMonitor.enabled=true"
SERVICE_MONITOR = "monitoring.serviceMonitor.enabled=true"
PROMETHEUS_RULE = "monitoring.prometheusRule.enabled=true"
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _tool(name: str, found: str | None, hint: str) -> str:
    if found is None:
        pytest.fail(f"{name} not found: {hint}", pytrace=False)
    return found


def _helm_binary() -> str:
    return _tool("helm", _find_helm(), "run `python -m splitserve_e2e.build` (or put helm on PATH)")


@functools.cache
def _promtool() -> str:
    """$SPLITSERVE_PROMTOOL, else Prometheus 3's promtool when the e2e harness has built it
    (e2e/splitserve_e2e/promoperator.py), else the one on PATH (Debian's, 2.x)."""
    explicit = os.environ.get("SPLITSERVE_PROMTOOL")
    pinned = sorted(glob.glob(str(Path.home() / ".cache" / "splitserve" / "bin" / "promtool-*" / "promtool")))
    found = explicit or (pinned[-1] if pinned and os.access(pinned[-1], os.X_OK) else shutil.which("promtool"))
    return _tool("promtool", found, "install Debian's `prometheus` package (.ci/deps does) or set $SPLITSERVE_PROMTOOL")


def _template(*sets: str, json_sets: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    args = [_helm_binary(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for item in sets:
        args += ["--set", item]
    for key, value in (json_sets or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


@functools.cache
def _render(*sets: str) -> tuple[dict[str, Any], ...]:
    proc = _template(*sets)
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def _of_kind(docs: Iterable[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _fails_with(message: str, *sets: str, json_sets: Mapping[str, Any] | None = None) -> None:
    proc = _template(*sets, json_sets=json_sets)
    assert proc.returncode != 0, f"rendered although it should fail with {message!r}"
    assert message in proc.stderr, proc.stderr


def _rules_of(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = _of_kind(docs, "PrometheusRule").values()
    spec: dict[str, Any] = rule["spec"]
    return spec


def _alerts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [r for group in spec["groups"] for r in group["rules"] if "alert" in r]


# ----------------------------------------------------------------- what the monitors must select
def _isvc(spec: dict[str, Any]) -> InferenceService:
    return InferenceService.parse(
        {
            "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
            "kind": contract.KIND,
            "metadata": {"name": "chat", "namespace": "team", "uid": "uid-1", "generation": 1},
            "spec": {"model": {"uri": "hf://org/model"}, **spec},
        }
    )


@functools.cache
def _children() -> tuple[dict[str, Any], ...]:
    """Every object the operator renders for a Disaggregated and an Aggregated service."""
    out: list[dict[str, Any]] = []
    specs: tuple[dict[str, Any], ...] = ({"prefill": {}, "decode": {}}, {"mode": "Aggregated", "aggregated": {}})
    for spec in specs:
        out += render_children(
            isvc=_isvc(spec),
            runtime_image="registry.example/splitserve:1",
            router_service_account="rel-splitserve-router",
        )
    return tuple(out)


def _pod_templates(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def _container_ports(pod_template: Mapping[str, Any]) -> set[str]:
    return {port["name"] for c in pod_template["spec"]["containers"] for port in c.get("ports", [])}


# ----------------------------------------------------------------- off by default, exclusive
def test_nothing_is_rendered_by_default() -> None:
    kinds = {d["kind"] for d in _render()}
    assert not kinds & set(MONITORING_KINDS)


def test_both_monitor_kinds_at_once_fail_with_a_clear_message() -> None:
    _fails_with(
        "monitoring.podMonitor.enabled and monitoring.serviceMonitor.enabled are mutually exclusive",
        POD_MONITOR,
        SERVICE_MONITOR,
    )


def test_lint_strict_with_monitoring() -> None:
    for sets in ((POD_MONITOR, PROMETHEUS_RULE), (SERVICE_MONITOR, PROMETHEUS_RULE)):
        args = [_helm_binary(), "lint", "--strict", str(CHART)]
        for item in sets:
            args += ["--set", item]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------- PodMonitors
def test_pod_monitors_select_the_inferenceservice_pods_and_the_operator_pods() -> None:
    docs = _render(
        POD_MONITOR,
        "monitoring.podMonitor.namespace=monitoring",
        "monitoring.podMonitor.additionalLabels.release=kube-prometheus-stack",
    )
    monitors = _of_kind(docs, "PodMonitor")
    assert set(monitors) == {f"{FULLNAME}-inferenceservices", f"{FULLNAME}-operator"}
    for monitor in monitors.values():
        assert monitor["metadata"]["namespace"] == "monitoring"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    workloads, operator = monitors[f"{FULLNAME}-inferenceservices"], monitors[f"{FULLNAME}-operator"]

    # every pod the operator renders (prefill, decode, router, engine), on its metrics port
    assert workloads["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = workloads["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == contract.HTTP_PORT_NAME and endpoint["path"] == contract.METRICS_PATH
    assert endpoint["interval"] == "15s"  # prometheus.scrapeIntervalSeconds
    assert "honorLabels" not in endpoint
    assert endpoint["relabelings"] == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", contract.LABEL_INSTANCE)],
            "targetLabel": "inferenceservice",
        },
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", contract.LABEL_ROLE)],
            "targetLabel": "role",
        },
    ]
    pods = _pod_templates(_children())
    roles = {p["metadata"]["labels"][contract.LABEL_ROLE] for p in pods}
    assert roles == {role.value for role in contract.Role}
    for pod in pods:
        assert _selects(workloads["spec"]["selector"], pod["metadata"]["labels"]), pod["metadata"]["labels"]
        assert endpoint["port"] in _container_ports(pod)

    # the operator pods, in the release namespace, with the autoscaler's labels kept
    (operator_pod,) = _pod_templates(docs)
    assert operator["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert _selects(operator["spec"]["selector"], operator_pod["metadata"]["labels"])
    (operator_endpoint,) = operator["spec"]["podMetricsEndpoints"]
    assert operator_endpoint["port"] == "metrics" and operator_endpoint["honorLabels"] is True
    assert operator_endpoint["port"] in _container_ports(operator_pod)

    # and neither picks up the other's pods (no duplicate series)
    assert not _selects(workloads["spec"]["selector"], operator_pod["metadata"]["labels"])
    assert not any(_selects(operator["spec"]["selector"], p["metadata"]["labels"]) for p in pods)


def test_pod_monitor_scrape_settings_and_namespace_list() -> None:
    docs = _render(
        POD_MONITOR,
        "monitoring.podMonitor.interval=30s",
        "monitoring.podMonitor.scrapeTimeout=10s",
        "monitoring.podMonitor.namespaceSelector.any=false",
        "monitoring.podMonitor.namespaceSelector.matchNames={team-a,team-b}",
    )
    monitors = _of_kind(docs, "PodMonitor")
    workloads = monitors[f"{FULLNAME}-inferenceservices"]
    assert workloads["metadata"]["namespace"] == NAMESPACE
    assert workloads["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    for monitor in monitors.values():
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "10s")


def test_default_interval_follows_a_fractional_scrape_interval() -> None:
    proc = _template(POD_MONITOR, json_sets={"prometheus.scrapeIntervalSeconds": 2.5})
    assert proc.returncode == 0, proc.stderr
    monitors = _of_kind(yaml.safe_load_all(proc.stdout), "PodMonitor")
    assert {m["spec"]["podMetricsEndpoints"][0]["interval"] for m in monitors.values()} == {"2500ms"}


@pytest.mark.parametrize("kind", ["podMonitor", "serviceMonitor"])
def test_namespace_selector_must_say_any_or_list_names(kind: str) -> None:
    enabled = f"monitoring.{kind}.enabled=true"
    _fails_with(
        f"monitoring.{kind}.namespaceSelector: set any: false when listing matchNames",
        enabled,
        f"monitoring.{kind}.namespaceSelector.matchNames={{team}}",
    )
    _fails_with(
        f"monitoring.{kind}.namespaceSelector: set any: true or list matchNames",
        enabled,
        f"monitoring.{kind}.namespaceSelector.any=false",
    )


# ----------------------------------------------------------------- ServiceMonitors
def test_service_monitors_select_the_inferenceservice_services_and_the_operator_service() -> None:
    docs = _render(SERVICE_MONITOR, "monitoring.serviceMonitor.additionalLabels.release=kps")
    monitors = _of_kind(docs, "ServiceMonitor")
    assert set(monitors) == {f"{FULLNAME}-inferenceservices", f"{FULLNAME}-operator"}
    assert all(m["metadata"]["labels"]["release"] == "kps" for m in monitors.values())
    assert all(m["metadata"]["namespace"] == NAMESPACE for m in monitors.values())
    workloads, operator = monitors[f"{FULLNAME}-inferenceservices"], monitors[f"{FULLNAME}-operator"]

    # every Service the operator renders (pools and router) exposes the metrics port, and
    # the pods behind it serve it
    assert workloads["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = workloads["spec"]["endpoints"]
    assert endpoint["port"] == contract.HTTP_PORT_NAME and endpoint["path"] == contract.METRICS_PATH
    assert endpoint["relabelings"][0]["targetLabel"] == "inferenceservice"
    services = [d for d in _children() if d["kind"] == "Service"]
    pods = _pod_templates(_children())
    assert len(services) == 5  # prefill, decode, router; engine, router
    for service in services:
        assert _selects(workloads["spec"]["selector"], service["metadata"]["labels"])
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        behind = [p for p in pods if _selects({"matchLabels": service["spec"]["selector"]}, p["metadata"]["labels"])]
        assert behind and all(port["targetPort"] in _container_ports(p) for p in behind)

    # the operator through its metrics Service
    operator_services = _of_kind(docs, "Service")
    assert [
        name for name, s in operator_services.items() if _selects(operator["spec"]["selector"], s["metadata"]["labels"])
    ] == [f"{FULLNAME}-metrics"]
    assert not any(_selects(workloads["spec"]["selector"], s["metadata"]["labels"]) for s in operator_services.values())
    assert not any(_selects(operator["spec"]["selector"], s["metadata"]["labels"]) for s in services)
    (operator_endpoint,) = operator["spec"]["endpoints"]
    assert operator_endpoint["port"] == "metrics" and operator_endpoint["honorLabels"] is True
    assert operator["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_service_monitor_needs_the_metrics_service() -> None:
    _fails_with(
        "monitoring.serviceMonitor.enabled needs metrics.service.enabled",
        SERVICE_MONITOR,
        "metrics.service.enabled=false",
    )


# ----------------------------------------------------------------- values schema
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("monitoring.podMonitor.interval=15 seconds", "interval"),
        ("monitoring.serviceMonitor.scrapeTimeout=fast", "scrapeTimeout"),
        ("monitoring.podMonitor.bogus=1", "bogus"),
        ("monitoring.prometheusRule.gpuPodPendingFor=", "gpuPodPendingFor"),
        ("monitoring.prometheusRule.runbookBaseUrl=docs/operator.md", "runbookBaseUrl"),
    ],
)
def test_schema_rejects_bad_monitoring_values(item: str, message: str) -> None:
    _fails_with(message, item)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("monitoring.prometheusRule.slo.timeToFirstTokenSeconds", 3),  # not a bucket bound
        ("monitoring.prometheusRule.slo.interTokenLatencySeconds", 0.12),
        ("monitoring.prometheusRule.slo.objective", 0.9),  # 14.4 x 10% budget > 1: never fires
        ("monitoring.prometheusRule.kvTransferFailureRatio", 0),
    ],
)
def test_schema_rejects_bad_thresholds(key: str, value: float) -> None:
    _fails_with(key.rsplit(".", 1)[1], json_sets={key: value})


def test_threshold_choices_are_the_runtime_histogram_buckets() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["monitoring"]["properties"]["prometheusRule"]["properties"]["slo"]["properties"]
    assert slo["timeToFirstTokenSeconds"]["enum"] == list(runtime_metrics.TTFT_BUCKETS)
    assert slo["interTokenLatencySeconds"]["enum"] == list(runtime_metrics.ITL_BUCKETS)


# ----------------------------------------------------------------- PrometheusRule
def test_prometheus_rule_needs_the_operator_job() -> None:
    _fails_with("monitoring.prometheusRule.operatorJob", PROMETHEUS_RULE)
    spec = _rules_of(_render(PROMETHEUS_RULE, "monitoring.prometheusRule.operatorJob=kubernetes-pods"))
    (down,) = [a for a in _alerts(spec) if a["alert"] == "SplitserveOperatorDown"]
    assert 'up{job="kubernetes-pods"}' in down["expr"]


@pytest.mark.parametrize(
    ("sets", "job"),
    [
        ((POD_MONITOR, "monitoring.podMonitor.namespace=monitoring"), f"monitoring/{FULLNAME}-operator"),
        ((SERVICE_MONITOR,), f"{FULLNAME}-metrics"),
    ],
)
def test_operator_job_is_the_one_the_enabled_monitor_gives(sets: tuple[str, ...], job: str) -> None:
    docs = _render(
        PROMETHEUS_RULE,
        "monitoring.prometheusRule.namespace=monitoring",
        "monitoring.prometheusRule.additionalLabels.release=kps",
        *sets,
    )
    (rule,) = _of_kind(docs, "PrometheusRule").values()
    assert rule["metadata"]["namespace"] == "monitoring" and rule["metadata"]["labels"]["release"] == "kps"
    (down,) = [a for a in _alerts(rule["spec"]) if a["alert"] == "SplitserveOperatorDown"]
    assert f'up{{job="{job}"}}' in down["expr"]


def test_values_reach_the_rules() -> None:
    proc = _template(
        POD_MONITOR,
        PROMETHEUS_RULE,
        "monitoring.prometheusRule.gpuPodPendingFor=30m",
        "monitoring.prometheusRule.runbookBaseUrl=https://wiki.example/splitserve",
        json_sets={
            "monitoring.prometheusRule.slo.objective": 0.995,
            "monitoring.prometheusRule.slo.timeToFirstTokenSeconds": 1,
            "monitoring.prometheusRule.slo.interTokenLatencySeconds": 0.0025,
            "monitoring.prometheusRule.kvTransferFailureRatio": 0.2,
        },
    )
    assert proc.returncode == 0, proc.stderr
    spec = _rules_of(yaml.safe_load_all(proc.stdout))
    text = json.dumps(spec)
    # `le` as Prometheus stores it (OpenMetrics floats): 1 is "1.0"
    assert 'splitserve_time_to_first_token_seconds_bucket{le=\\"1.0\\"}' in text
    assert 'splitserve_inter_token_latency_seconds_bucket{le=\\"0.0025\\"}' in text
    assert "(14.4 * (1 - 0.995))" in text and "(6 * (1 - 0.995))" in text
    alerts = {a["alert"]: a for a in _alerts(spec)}
    assert alerts["SplitserveKVTransferFailures"]["expr"].rstrip().endswith("> 0.2")
    assert alerts["SplitserveGPUPodsPending"]["for"] == "30m"
    assert alerts["SplitserveOperatorDown"]["annotations"]["runbook_url"] == (
        "https://wiki.example/splitserve#alert-splitserveoperatordown"
    )


EXPECTED_ALERTS = {
    "SplitserveTTFTSLOBurn",
    "SplitserveITLSLOBurn",
    "SplitserveKVTransferFailures",
    "SplitserveMetricsUnhealthy",
    "SplitserveGPUPodsPending",
    "SplitserveInferenceServiceStalled",
    "SplitserveOperatorNoLeader",
    "SplitserveOperatorDown",
}


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    alerts = _alerts(_rules_of(_render(POD_MONITOR, PROMETHEUS_RULE)))
    assert {a["alert"] for a in alerts} == EXPECTED_ALERTS
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, alert["alert"]
        assert annotations["runbook_url"] == (
            f"https://github.com/splitserve/splitserve/blob/main/docs/operator.md#alert-{alert['alert'].lower()}"
        )
    burns = [a["labels"]["severity"] for a in alerts if a["alert"] == "SplitserveTTFTSLOBurn"]
    assert sorted(burns) == ["critical", "warning"]  # fast and slow burn


def _contract_metric_names() -> set[str]:
    return {value for cls in (Metric, OperatorMetric) for key, value in vars(cls).items() if key.isupper()}


def unknown_metric_names(text: str) -> set[str]:
    """splitserve_* metric names in ``text`` that the contract does not define (a histogram's
    _bucket/_count/_sum series count as the histogram's name)."""
    known = _contract_metric_names()
    found = set(re.findall(r"(?<![A-Za-z0-9_:])splitserve_[a-z0-9_]+", text))
    return {
        name
        for name in found
        if name not in known and not any(name.endswith(s) and name[: -len(s)] in known for s in HISTOGRAM_SUFFIXES)
    }


def test_rules_and_monitors_use_only_metric_names_of_the_contract() -> None:
    docs = [
        d
        for sets in ((POD_MONITOR, PROMETHEUS_RULE), (SERVICE_MONITOR, PROMETHEUS_RULE))
        for d in _render(*sets)
        if d["kind"] in MONITORING_KINDS
    ]
    text = yaml.safe_dump_all(docs)
    assert unknown_metric_names(text) == set()
    for name in (
        Metric.TIME_TO_FIRST_TOKEN_SECONDS,
        Metric.INTER_TOKEN_LATENCY_SECONDS,
        Metric.KV_TRANSFER_FAILURES_TOTAL,
        OperatorMetric.AUTOSCALER_DECISIONS_TOTAL,
    ):
        assert name in text
    # the check itself catches a name the contract lacks
    assert unknown_metric_names(text + "\nexpr: rate(splitserve_operator_leader_total[5m])") == {
        "splitserve_operator_leader_total"
    }


# ----------------------------------------------------------------- promtool
def _promtool_run(rules: Mapping[str, Any], workdir: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` (must pass) then ``promtool test rules`` (returned)."""
    (workdir / "rules.yaml").write_text(yaml.safe_dump(dict(rules), sort_keys=False, width=1000))
    shutil.copyfile(RULES_TEST, workdir / RULES_TEST.name)
    check = subprocess.run(
        [_promtool(), "check", "rules", "rules.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout
    return subprocess.run(
        [_promtool(), "test", "rules", RULES_TEST.name],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_rules_pass_promtool_check_and_unit_tests(tmp_path: Path) -> None:
    result = _promtool_run(_rules_of(_render(POD_MONITOR, PROMETHEUS_RULE)), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # every alert is exercised by the unit tests
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test.get("alert_rule_test", [])}
    assert tested == EXPECTED_ALERTS


def test_promtool_unit_tests_catch_a_changed_rule(tmp_path: Path) -> None:
    spec = _rules_of(_render(POD_MONITOR, PROMETHEUS_RULE))
    broken = json.loads(json.dumps(spec).replace('le=\\"2.5\\"', 'le=\\"5.0\\"').replace("> 0.05", "> 0.5"))
    assert broken != spec
    result = _promtool_run(broken, tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "alertname: SplitserveTTFTSLOBurn" in output
    assert "alertname: SplitserveKVTransferFailures" in output
    assert "alertname: SplitserveOperatorDown" not in output
