"""The chart's Prometheus Operator objects against the Prometheus Operator's real CRDs and
Prometheus 3's promtool: every monitoring toggle renders manifests the API server accepts
(server-side dry run, strict field validation, the CRDs' OpenAPI schemas), the schemas really
validate (a deliberately broken monitor or rule is refused), and the rendered rules pass
``promtool check rules`` and the alert unit tests (tests/operator/chart/fixtures/
prometheus-rules.test.yaml) on the Prometheus version kube-prometheus-stack runs."""

from __future__ import annotations

import copy
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve_e2e import build, promoperator
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.stack import create_namespace

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "splitserve"
RULES_TEST = REPO / "tests" / "operator" / "chart" / "fixtures" / "prometheus-rules.test.yaml"
RELEASE = "rel"
FULLNAME = "rel-splitserve"


@pytest.fixture(scope="module")
def monitoring_crds(cluster: LocalCluster) -> Iterator[list[str]]:
    """PodMonitor, ServiceMonitor and PrometheusRule CRDs on the cluster for this module;
    those it created are deleted afterwards (no other test uses them)."""
    created = promoperator.install_crds(cluster, promoperator.ensure_crds())
    yield list(promoperator.CRD_NAMES)
    promoperator.remove_crds(cluster, created)


@pytest.fixture(scope="module")
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """One namespace for the module: every apply here is a dry run, nothing stays in it."""
    name = f"e2e-prometheus-operator-{uuid.uuid4().hex[:5]}"
    create_namespace(cluster, name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _template(cluster: LocalCluster, namespace: str, *sets: str) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    return cluster.helm(*args).stdout


def _dry_run(cluster: LocalCluster, namespace: str, manifests: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-", input_text=manifests, check=False
    )


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ("monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true"),
            {
                f"podmonitor.monitoring.coreos.com/{FULLNAME}-inferenceservices",
                f"podmonitor.monitoring.coreos.com/{FULLNAME}-operator",
                f"prometheusrule.monitoring.coreos.com/{FULLNAME}",
            },
        ),
        (
            (
                "monitoring.serviceMonitor.enabled=true",
                "monitoring.prometheusRule.enabled=true",
                "monitoring.serviceMonitor.interval=30s",
                "monitoring.serviceMonitor.scrapeTimeout=10s",
                "monitoring.serviceMonitor.additionalLabels.release=kube-prometheus-stack",
                "monitoring.prometheusRule.additionalLabels.release=kube-prometheus-stack",
            ),
            {
                f"servicemonitor.monitoring.coreos.com/{FULLNAME}-inferenceservices",
                f"servicemonitor.monitoring.coreos.com/{FULLNAME}-operator",
                f"prometheusrule.monitoring.coreos.com/{FULLNAME}",
            },
        ),
        (
            (
                "monitoring.podMonitor.enabled=true",
                "monitoring.podMonitor.namespaceSelector.any=false",
                "monitoring.podMonitor.namespaceSelector.matchNames={team-a,team-b}",
            ),
            {
                f"podmonitor.monitoring.coreos.com/{FULLNAME}-inferenceservices",
                f"podmonitor.monitoring.coreos.com/{FULLNAME}-operator",
            },
        ),
        (
            ("monitoring.prometheusRule.enabled=true", "monitoring.prometheusRule.operatorJob=kubernetes-pods"),
            {f"prometheusrule.monitoring.coreos.com/{FULLNAME}"},
        ),
        # the Grafana dashboard toggle: a ConfigMap the sidecar picks up, no monitoring objects
        (("dashboards.enabled=true", "dashboards.annotations.grafana_folder=LLM serving"), set()),
    ],
    ids=["podmonitor+rule", "servicemonitor+rule", "podmonitor-matchnames", "rule-only", "dashboards"],
)
def test_every_monitoring_toggle_passes_server_validation(
    cluster: LocalCluster, monitoring_crds: list[str], namespace: str, sets: tuple[str, ...], expected: set[str]
) -> None:
    manifests = _template(cluster, namespace, *sets)
    result = _dry_run(cluster, namespace, manifests)
    assert result.returncode == 0, result.stderr
    applied = {line.split()[0] for line in result.stdout.splitlines() if "monitoring.coreos.com" in line}
    assert applied == expected, result.stdout
    if "dashboards.enabled=true" in sets:
        assert any(line.startswith("configmap/") and "dashboard" in line for line in result.stdout.splitlines()), (
            result.stdout
        )


def _one(manifests: str, kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in yaml.safe_load_all(manifests) if d and d["kind"] == kind and d["metadata"]["name"] == name]
    return dict(found)


def _broken_interval(monitor: dict[str, Any]) -> None:
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"


def _unknown_field(monitor: dict[str, Any]) -> None:
    monitor["spec"]["podMetricsEndpoints"][0]["portName"] = "http"


def _rule_without_expr(rule: dict[str, Any]) -> None:
    del rule["spec"]["groups"][1]["rules"][0]["expr"]


@pytest.mark.parametrize(
    ("kind", "name", "breakage", "message"),
    [
        (
            "PodMonitor",
            f"{FULLNAME}-inferenceservices",
            _broken_interval,
            "spec.podMetricsEndpoints[0].interval in body should match",
        ),
        (
            "PodMonitor",
            f"{FULLNAME}-operator",
            _unknown_field,
            ".spec.podMetricsEndpoints[0].portName: field not declared in schema",
        ),
        ("PrometheusRule", FULLNAME, _rule_without_expr, "spec.groups[1].rules[0].expr: Required value"),
    ],
    ids=["interval-pattern", "unknown-field", "rule-without-expr"],
)
def test_the_crds_refuse_a_broken_object(
    cluster: LocalCluster,
    monitoring_crds: list[str],
    namespace: str,
    kind: str,
    name: str,
    breakage: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    manifests = _template(
        cluster, namespace, "monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true"
    )
    good = _one(manifests, kind, name)
    assert _dry_run(cluster, namespace, yaml.safe_dump(good)).returncode == 0
    broken = copy.deepcopy(good)
    breakage(broken)
    result = _dry_run(cluster, namespace, yaml.safe_dump(broken))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_rules_pass_prometheus_3_promtool(tmp_path: Path) -> None:
    promtool = promoperator.ensure_promtool()
    helm = build.ensure_binaries().helm
    rendered = subprocess.run(
        [
            str(helm),
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            "ops",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    spec = yaml.safe_load(rendered)["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False, width=1000))
    num_rules = sum(len(group["rules"]) for group in spec["groups"])
    shutil.copyfile(RULES_TEST, tmp_path / RULES_TEST.name)
    check = subprocess.run(
        [str(promtool), "check", "rules", "rules.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0 and f"SUCCESS: {num_rules} rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run(
        [str(promtool), "test", "rules", RULES_TEST.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
