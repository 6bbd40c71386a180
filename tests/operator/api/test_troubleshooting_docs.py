"""docs/operator.md#troubleshooting explains every condition type and reason the operator
writes (the single source: ``splitserve_contract.ConditionType`` and ``Reason``), and nothing
else; the Alerts subsection has exactly one heading per ``runbook_url`` anchor the chart's
alert rules point at; the Upgrading section holds the command blocks the upgrade e2e test
runs."""

from __future__ import annotations

import re
from pathlib import Path

import crdgen
import pytest

from splitserve_contract import ConditionType, Reason
from splitserve_operator import failures

REPO = Path(__file__).resolve().parents[3]
DOC = (REPO / crdgen.DOC_PATH).read_text()
CHART = REPO / "helm" / "splitserve"

ROW_NAMES = re.compile(r"`([A-Za-z][A-Za-z0-9]*)`")
RUNBOOK_ANCHOR = re.compile(r"runbook_url:.*#(alert-[a-z0-9-]+)")


def section(title: str, *, level: int = 2) -> str:
    """The text of the ``## title`` section, up to the next heading of the same level."""
    hashes = "#" * level
    match = re.search(rf"^{hashes} {re.escape(title)}\n(.*?)(?=^{hashes} |\Z)", DOC, flags=re.S | re.M)
    assert match is not None, f"docs/operator.md has no '{hashes} {title}' section"
    return match.group(1)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than '-' dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def documented_names() -> set[str]:
    """The backticked names in the first cell of every table row of the Troubleshooting section."""
    names: set[str] = set()
    for line in section("Troubleshooting").splitlines():
        if line.startswith("| `"):
            names.update(ROW_NAMES.findall(line.split("|")[1]))
    return names


def contract_reasons() -> set[str]:
    return {value for name, value in vars(Reason).items() if name.isupper() and isinstance(value, str)}


def test_every_reason_has_an_entry() -> None:
    missing = contract_reasons() - documented_names()
    assert not missing, f"Reasons without a row in docs/operator.md#troubleshooting: {sorted(missing)}"


def test_every_condition_type_has_an_entry() -> None:
    missing = {str(t) for t in ConditionType} - documented_names()
    assert not missing, f"condition types without a row in docs/operator.md#troubleshooting: {sorted(missing)}"


def test_no_entry_for_a_reason_the_operator_does_not_write() -> None:
    """Rows name only contract reasons, condition types, or the kubelet's waiting reasons that
    the operator passes through (:data:`splitserve_operator.failures.WAITING_FAILURES`)."""
    known = contract_reasons() | {str(t) for t in ConditionType} | set(failures.WAITING_FAILURES)
    stray = documented_names() - known
    assert not stray, f"rows for reasons the operator never writes: {sorted(stray)}"


def test_troubleshooting_anchor_and_how_to_look() -> None:
    assert github_anchor("Troubleshooting") == "troubleshooting"
    text = section("Troubleshooting")
    for needle in (
        "kubectl get sis -o wide",
        "kubectl describe sis",
        "recentDecisions",
        "--previous",
        "terminated.message",
        "kubectl get events",
    ):
        assert needle in text, needle


def alert_headings() -> list[str]:
    return re.findall(r"^#### (Alert: \S+)$", section("Troubleshooting"), flags=re.M)


def test_alert_headings_make_runbook_anchors() -> None:
    anchors = [github_anchor(h) for h in alert_headings()]
    assert anchors, "no '#### Alert: <name>' headings under Troubleshooting"
    assert len(anchors) == len(set(anchors)), anchors
    for heading, anchor in zip(alert_headings(), anchors, strict=True):
        assert anchor == "alert-" + heading.removeprefix("Alert: ").lower(), (heading, anchor)
    # a heading elsewhere in the page with the same anchor would turn ours into <anchor>-1
    all_anchors = [github_anchor(h) for h in re.findall(r"^#+ (.+)$", DOC, flags=re.M)]
    assert [a for a in all_anchors if a.startswith("alert-")] == anchors


def test_every_runbook_url_in_the_chart_has_its_heading() -> None:
    """Every ``runbook_url: ...#alert-...`` in the chart's files lands on one heading."""
    referenced = {a for path in CHART.rglob("*.yaml") for a in RUNBOOK_ANCHOR.findall(path.read_text())}
    missing = referenced - {github_anchor(h) for h in alert_headings()}
    assert not missing, f"runbook anchors without a heading in docs/operator.md: {sorted(missing)}"


@pytest.mark.parametrize("marker", ["UPGRADE STEPS", "ROLLBACK STEPS"])
def test_upgrading_holds_the_command_blocks(marker: str) -> None:
    text = section("Upgrading")
    match = re.search(rf"<!-- BEGIN {marker} .*?-->\n```sh\n(.*?)```\n<!-- END {marker} -->", text, flags=re.S)
    assert match is not None, marker
    commands = [line for line in match.group(1).splitlines() if line and not line.startswith("#")]
    assert [c.split()[0] for c in commands] == ["kubectl", "kubectl", "kubectl", "helm"], commands
    assert "--server-side --force-conflicts" in commands[2]
