"""``splitserve plan --slo``: parsing, the controller report and the prior in the manifest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from splitserve_operator.api import InferenceService
from splitserve_planner.cli import main
from splitserve_planner.slo_plan import parse_slo


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_parse_slo_accepts_durations_and_refuses_nonsense() -> None:
    slo = parse_slo("ttft=500ms,itl=50ms")
    assert (slo.ttft_p99_seconds, slo.itl_p99_seconds, slo.attainment, slo.headroom) == (0.5, 0.05, 0.99, 0.8)
    slo = parse_slo("itl=0.04s, ttft=2s, attainment=0.95, headroom=0.7")
    assert (slo.ttft_p99_seconds, slo.itl_p99_seconds, slo.attainment, slo.headroom) == (2.0, 0.04, 0.95, 0.7)
    assert parse_slo("ttft=800,itl=30").ttft_p99_seconds == pytest.approx(0.8)  # bare numbers are ms
    for bad, message in (
        ("ttft=1s", "needs both"),
        ("ttft=1s,itl=50ms,p=3", "bad --slo"),
        ("ttft=fast,itl=50ms", "duration"),
        ("ttft=1s,itl=50ms,attainment=1.5", "attainment"),
        ("ttft=0ms,itl=50ms", "above 0"),
        ("ttft=1s,itl=50ms,headroom=0", "headroom"),
        ("ttft=1s,ttft=2s,itl=5ms", "bad --slo"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_slo(bad)


def test_plan_slo_reports_the_controller_and_writes_the_prior(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "isvc.yaml"
    code, out, err = _run(
        capsys,
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "L40S",
        "--tp",
        "1",
        "--rate",
        "10",
        "--duration-s",
        "180",
        "--slo",
        "ttft=1s,itl=50ms,attainment=0.95",
        "--emit-manifest",
        str(manifest),
        "--name",
        "slo-plan",
    )
    assert code == 0, err
    assert "SLO ttft" not in err
    assert "SLOs: TTFT p99 <= 1000 ms, ITL p99 <= 50 ms" in out  # --slo sets the planning SLOs
    report = out.split("SLO controller", 1)[1]
    attainment = float(re.search(r"attainment ([0-9.]+)% of (\d+) requests", report).group(1))  # type: ignore[union-attr]
    assert 0.0 < attainment <= 100.0
    assert re.search(r"[0-9.]+ GPU-hours", report)
    assert re.search(r"(aggregated|prefill) replicas \d+-\d+: 0s:\d+", report)
    obj = yaml.safe_load(manifest.read_text())
    isvc = InferenceService.parse(obj)
    slo = obj["spec"]["autoscaling"]["slo"]
    assert (slo["ttftP99"], slo["itlP99"], slo["attainment"]) == ("1000ms", "50ms", 0.95)
    prior = slo["prior"]
    assert set(prior) == {"step", "prefillToken", "prefillPair", "decodeRow", "decodeContext"}
    assert all(v >= 0 for v in prior.values()) and prior["step"] > 0 and prior["prefillToken"] > 0
    assert isvc.spec.autoscaling.slo is not None
    assert isvc.spec.autoscaling.slo.prior is not None
    assert isvc.spec.autoscaling.slo.prior.prefill_token == pytest.approx(prior["prefillToken"])
    assert f"prefillToken={prior['prefillToken']:.4g}" in report


def test_plan_without_slo_writes_no_slo_block(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    manifest = tmp_path / "isvc.yaml"
    code, out, err = _run(
        capsys,
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "L40S",
        "--tp",
        "1",
        "--rate",
        "4",
        "--duration-s",
        "60",
        "--emit-manifest",
        str(manifest),
    )
    assert code == 0, err
    assert "SLO controller" not in out
    assert "slo" not in yaml.safe_load(manifest.read_text())["spec"]["autoscaling"]


def test_plan_refuses_a_bad_slo_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rate", "4", "--slo", "ttft=1s"])
    assert exc.value.code == 2
    assert "needs both ttft= and itl=" in capsys.readouterr().err
