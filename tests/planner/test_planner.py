"""The planner: monotone answers, feasibility errors, manifests the API accepts, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from splitserve_contract import capabilities as caps
from splitserve_operator.api import InferenceService
from splitserve_planner.cli import main
from splitserve_planner.manifest import build_manifest
from splitserve_planner.perf_model import RooflineModel
from splitserve_planner.precision import KV_CACHE_DTYPES, QUANTIZATIONS, Precision
from splitserve_planner.search import PlanError, PlanInputs, Slo, check_feasible, plan_all
from splitserve_planner.simulator import ROUTER_POLICIES
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec


def _requests(rate: float, seconds: float = 60.0) -> list[Request]:
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate),
        prompt_tokens=LengthDist.parse("lognormal:2048:0.8"),
        output_tokens=LengthDist.parse("lognormal:256:0.8"),
    )
    return spec.generate(duration_seconds=seconds, seed=0)


def _gpus(perf: RooflineModel, *, rate: float, ttft_ms: float = 600, itl_ms: float = 40) -> dict[str, int]:
    table = plan_all(
        PlanInputs(
            perf=perf, requests=_requests(rate), slo=Slo(ttft_p99_seconds=ttft_ms / 1e3, itl_p99_seconds=itl_ms / 1e3)
        ),
        compare_prefix_caching=False,
    )
    return {label: plan.num_gpus for label, plan in table.plans.items() if plan is not None}


def test_more_load_never_needs_fewer_gpus(llama8b_h100: RooflineModel) -> None:
    answers = [_gpus(llama8b_h100, rate=rate) for rate in (4, 8, 16, 32)]
    for label in answers[0]:
        counts = [a[label] for a in answers]
        assert counts == sorted(counts), f"{label}: {counts}"
        assert counts[-1] > counts[0], f"{label}: 8x the load should need more GPUs: {counts}"


def test_stricter_slos_never_need_fewer_gpus(llama8b_h100: RooflineModel) -> None:
    loose = _gpus(llama8b_h100, rate=16, ttft_ms=2000, itl_ms=60)
    strict = _gpus(llama8b_h100, rate=16, ttft_ms=700, itl_ms=12)
    for label, count in loose.items():
        assert strict.get(label, 10**9) >= count, f"{label}: strict {strict.get(label)} < loose {count}"


def test_impossible_slos_are_explained(llama8b_h100: RooflineModel) -> None:
    requests = _requests(4)
    with pytest.raises(PlanError, match="impossible ITL SLO.*single sequence"):
        check_feasible(
            PlanInputs(perf=llama8b_h100, requests=requests, slo=Slo(ttft_p99_seconds=1, itl_p99_seconds=0.001))
        )
    with pytest.raises(PlanError, match="impossible TTFT SLO.*p99-length prompt"):
        check_feasible(
            PlanInputs(perf=llama8b_h100, requests=requests, slo=Slo(ttft_p99_seconds=0.005, itl_p99_seconds=0.05))
        )
    with pytest.raises(PlanError, match="headroom"):
        PlanInputs(
            perf=llama8b_h100, requests=requests, slo=Slo(ttft_p99_seconds=1, itl_p99_seconds=0.05), headroom=1.5
        )


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--gpu", "X100", "--rate", "1"),
            "unknown GPU 'X100'; known GPUs: A100-80GB, A10G, B200, H100-PCIe, H100-SXM, H200, L40S",
        ),
        (("--model", "llama-3.1-70b", "--gpu", "H100", "--tp", "1", "--rate", "1"), "needs 151.8 GiB per GPU at TP=1"),
        (("--model", "gpt-5", "--rate", "1"), "unknown model 'gpt-5': not a preset"),
        (("--rate", "2", "--itl-p99-ms", "1"), "impossible ITL SLO"),
        (("--rate", "2", "--ttft-p99-ms", "5"), "impossible TTFT SLO"),
        (("--rate", "0"), "--rate must be > 0"),
        ((), "give --rate (requests/s) or --trace"),
        (("--rate", "1", "--prompt-tokens", "gaussian:5"), "bad token distribution 'gaussian:5'"),
        (("--rate", "1", "--dtype", "fp8", "--gpu", "A100", "--what-if"), "A100-80GB has no FP8 tensor cores"),
        (
            ("--rate", "1", "--quantization", "fp8", "--gpu", "A100"),
            "A100-80GB has no FP8 tensor cores: --quantization fp8 needs one of H100-SXM, H100-PCIe, H200, L40S, B200; "
            "use --quantization int8 or int4 on it",
        ),
        (
            ("--rate", "1", "--kv-cache-dtype", "fp8", "--gpu", "A10G"),
            "A10G has no FP8 support: --kv-cache-dtype fp8 needs",
        ),
        (
            ("--rate", "1", "--dtype", "fp8", "--quantization", "int4"),
            "--dtype fp8 means --quantization fp8; it conflicts",
        ),
        (("--rate", "1", "--quantization", "fp4"), "argument --quantization: invalid choice: 'fp4'"),
        (
            ("--rate", "1", "--quantization", "int8", "--profile", "p.json"),
            "--profile holds timings measured at one precision",
        ),
        (
            ("--rate", "1", "--dtype", "int4"),
            "--dtype must be bfloat16, float16 or float32 (or fp8, an alias for "
            "--quantization fp8), got 'int4'; weight quantization is --quantization none|fp8|int8|int4",
        ),
        (("--rate", "1", "--tp", "3"), "--tp must be auto or 1, 2, 4 or 8"),
        (("--rate", "1", "--bogus"), "unrecognized arguments: --bogus"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    if "--bogus" in argv or "fp4" in argv:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
        return
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err


def test_cli_bad_profile_and_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schemaVersion": 1, "kind": "PerfProfile", "device": "cpu"}))
    code, _, err = _run(capsys, "--rate", "1", "--profile", str(profile))
    assert code == 2 and "is invalid: model: Field required" in err
    profile.write_text(json.dumps({"schemaVersion": 7}))
    code, _, err = _run(capsys, "--rate", "1", "--profile", str(profile))
    assert code == 2 and "schemaVersion must be 1, got 7" in err
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,prompt_tokens,output_tokens\n0.0,100,10\n0.5,abc,10\n")
    code, _, err = _run(capsys, "--trace", str(trace))
    assert code == 2 and "line 3" in err
    trace.write_text("time,prompt\n1,2\n")
    code, _, err = _run(capsys, "--trace", str(trace))
    assert code == 2 and "missing column(s) output_tokens, prompt_tokens, timestamp" in err


def test_cli_plans_emits_a_valid_manifest_and_a_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    manifest, png = tmp_path / "isvc.yaml", tmp_path / "latency.png"
    code, out, err = _run(
        capsys,
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H200",
        "--rate",
        "8",
        "--duration-s",
        "40",
        "--prompt-tokens",
        "lognormal:2048:0.6",
        "--prefix-share",
        "0.5",
        "--prefix-tokens",
        "1024",
        "--ttft-p99-ms",
        "1500",
        "--itl-p99-ms",
        "30",
        "--emit-manifest",
        str(manifest),
        "--plot",
        str(png),
        "--name",
        "llama-plan",
    )
    assert code == 0, err
    assert "disaggregated, prefix cache" in out and "aggregated, no prefix cache" in out
    assert "chosen:" in out
    obj = yaml.safe_load(manifest.read_text())
    isvc = InferenceService.parse(obj)
    assert isvc.metadata.name == "llama-plan"
    pools = [p for p in (isvc.spec.prefill, isvc.spec.decode, isvc.spec.aggregated) if p is not None]
    assert pools and all(1 <= p.replicas.min <= p.replicas.max for p in pools)
    assert isvc.spec.autoscaling.gpu_budget == sum(p.replicas.max * p.resources.gpus for p in pools)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_with_the_shipped_cpu_profile(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve_planner.profile import shipped_profiles

    (profile,) = [p for p in shipped_profiles() if p.name == "cpu-tiny-llama.json"]
    code, out, err = _run(
        capsys,
        "--model",
        "tiny",
        "--profile",
        str(profile),
        "--rate",
        "5",
        "--duration-s",
        "60",
        "--prompt-tokens",
        "uniform:32:256",
        "--output-tokens",
        "uniform:8:48",
        "--ttft-p99-ms",
        "2000",
        "--itl-p99-ms",
        "100",
        "--max-num-seqs",
        "64",
        "--max-batched-tokens",
        "2048",
    )
    assert code == 0, err
    assert "profile" in out and "chosen:" in out


PRECISIONS = [
    Precision(dtype=dtype, quantization=quantization, kv_cache_dtype=kv)
    for dtype in ("bfloat16", "float16")
    for quantization in QUANTIZATIONS
    for kv in KV_CACHE_DTYPES
]


@pytest.mark.parametrize(
    ("rate", "prompt", "output", "prefix_share"),
    [
        (6, "lognormal:2048:0.8", "lognormal:256:0.8", 0.0),
        (12, "lognormal:512:0.6", "lognormal:512:0.6", 0.6),
        (3, "uniform:4000:6000", "exponential:128", 0.3),
    ],
)
def test_every_manifest_the_planner_can_emit_parses(
    llama8b_h100: RooflineModel, rate: float, prompt: str, output: str, prefix_share: float
) -> None:
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate),
        prompt_tokens=LengthDist.parse(prompt),
        output_tokens=LengthDist.parse(output),
        prefix_share=prefix_share,
        prefix_tokens=1024 if prefix_share else 0,
    )
    requests = spec.generate(duration_seconds=30, seed=0)
    table = plan_all(
        PlanInputs(perf=llama8b_h100, requests=requests, slo=Slo(ttft_p99_seconds=1.5, itl_p99_seconds=0.05))
    )
    plans = [plan for plan in table.plans.values() if plan is not None]
    assert plans
    for plan in plans:
        assert plan.gpus_per_replica in caps.TENSOR_PARALLEL_SIZE.supported
        for precision in PRECISIONS:
            for router in ROUTER_POLICIES:
                manifest = build_manifest(
                    plan=plan,
                    name="planned",
                    model_uri="hf://meta-llama/Llama-3.1-8B",
                    precision=precision,
                    min_replicas={"prefill": 1, "decode": 1, "aggregated": 1},
                    router_policy=router,
                    memory_fraction=0.9,
                    max_num_seqs=256,
                    block_size=16,
                )
                isvc = InferenceService.parse(manifest)
                assert isvc.spec.model.dtype == precision.dtype
                assert isvc.spec.model.quantization == precision.quantization
                assert isvc.spec.kv_cache.dtype == precision.kv_cache_dtype
                assert ("dtype" in manifest["spec"]["kvCache"]) == (precision.kv_cache_dtype == "fp8")
                pools = [p for p in (isvc.spec.prefill, isvc.spec.decode, isvc.spec.aggregated) if p is not None]
                assert all(p.parallelism.tensor == 1 for p in pools)


@pytest.fixture
def tp_1_only(monkeypatch: pytest.MonkeyPatch) -> caps.Capability:
    """The capabilities table narrowed to TP 1 (as it was before tensor parallelism landed): every
    TP size is served now, so this is how a size the API knows but the version does not serve is
    exercised (the planner reads the table at call time)."""
    narrowed = dataclasses.replace(caps.TENSOR_PARALLEL_SIZE, supported=(1,))
    monkeypatch.setattr(caps, "TENSOR_PARALLEL_SIZE", narrowed)
    return narrowed


def test_every_tp_size_is_servable_now() -> None:
    assert caps.TENSOR_PARALLEL_SIZE.supported == caps.TENSOR_PARALLEL_SIZE.known == (1, 2, 4, 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--rate", "1", "--tp", "4"),
            "parallelism.tensor 4 is not supported by this version of splitserve (supported: 1); "
            "--what-if prices it with the roofline anyway",
        ),
        (
            ("--rate", "1", "--tp", "2", "--what-if", "--emit-manifest", "x.yaml"),
            "--emit-manifest writes only what this version serves: parallelism.tensor 2 is not supported",
        ),
    ],
)
def test_cli_refuses_a_size_the_table_does_not_serve(
    tp_1_only: caps.Capability, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err


def test_cli_auto_plans_only_the_sizes_the_table_serves(
    tp_1_only: caps.Capability, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "--model", "llama-3.1-70b", "--gpu", "H100", "--rate", "1", "--duration-s", "20")
    assert code == 2 and "TP=2" not in out
    assert "no tensor-parallel size has a plan: TP=1: llama-3.1-70b (bfloat16) needs 151.8 GiB per GPU at TP=1" in err
    assert "a larger --tp" not in err  # not a remedy this (narrowed) version offers


def test_unsupported_settings_never_reach_a_plan_or_a_manifest(
    tp_1_only: caps.Capability, llama8b_h100: RooflineModel
) -> None:
    requests = _requests(4, seconds=20)
    slo = Slo(ttft_p99_seconds=1, itl_p99_seconds=0.05)
    with pytest.raises(PlanError, match="parallelism.tensor 2 is not supported by this version of splitserve"):
        PlanInputs(perf=llama8b_h100, requests=requests, slo=slo, gpus_per_replica=2)
    what_if = plan_all(
        PlanInputs(perf=llama8b_h100, requests=requests, slo=slo, gpus_per_replica=2, what_if=True),
        compare_prefix_caching=False,
    ).best
    assert what_if is not None and what_if.gpus_per_replica == 2
    with pytest.raises(caps.UnsupportedError, match="parallelism.tensor 2 is not supported"):
        build_manifest(
            plan=what_if,
            name="x",
            model_uri="hf://x/y",
            precision=Precision(),
            min_replicas={},
            router_policy="least-load",
            memory_fraction=0.9,
            max_num_seqs=256,
            block_size=16,
        )
    with pytest.raises(caps.UnsupportedError, match="parallelism.tensor 2 is not supported"):  # quantized or not
        build_manifest(
            plan=what_if,
            name="x",
            model_uri="hf://x/y",
            precision=Precision(quantization="int4"),
            min_replicas={},
            router_policy="least-load",
            memory_fraction=0.9,
            max_num_seqs=256,
            block_size=16,
        )


def test_cli_what_if_is_labelled_and_writes_no_manifest(
    tp_1_only: caps.Capability, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "--rate", "4", "--duration-s", "30", "--tp", "2", "--dtype", "fp8", "--what-if")
    assert code == 0, err
    assert "TP=2, bfloat16, fp8 weights (W8A8)" in out  # --dtype fp8: the alias for --quantization fp8
    assert "WHAT-IF (not servable by this version, no manifest)" in out
    assert caps.TENSOR_PARALLEL_SIZE.unsupported_message(2) in out
    assert "quantization fp8" not in out  # served by this version: not part of the what-if
    assert "\nwhat-if, not servable by this version: " in out and "\nchosen:" not in out
