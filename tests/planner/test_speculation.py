"""Speculative decoding in the planner: the tokens-per-forward formula, the cost of a
verification forward on the roofline, the runtime's batch rule in the capacity model and the
simulator, and the CLI flags down to the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve_operator.api import InferenceService
from splitserve_planner.cli import main
from splitserve_planner.perf_model import RooflineModel, decode_step_seconds
from splitserve_planner.search import PlanError, PlanInputs, Slo, check_feasible
from splitserve_planner.simulator import (
    AGGREGATED,
    DISAGGREGATED,
    EngineSettings,
    FleetConfig,
    SimOptions,
    simulate,
)
from splitserve_planner.speculation import (
    DEFAULT_ACCEPTANCE,
    Speculation,
    decode_capacity,
    decode_forward_seconds,
    decode_seconds_per_token,
    expected_tokens_per_forward,
    verify_step_seconds,
)
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec


def _ngram(acceptance: float = 0.8, *, k: int = 4, limit: int = 16) -> Speculation:
    return Speculation(method="ngram", num_tokens=k, acceptance=acceptance, max_num_seqs=limit)


@pytest.mark.parametrize(("a", "k"), [(0.0, 4), (0.3, 4), (0.5, 2), (0.8, 4), (0.95, 8), (1.0, 4)])
def test_tokens_per_forward_is_the_expected_accepted_prefix_plus_one(a: float, k: int) -> None:
    # E = sum_{i=0..k} a^i: the i-th proposal is kept only if it and all before it are accepted
    assert expected_tokens_per_forward(acceptance=a, num_tokens=k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens_per_forward(acceptance=0.5, num_tokens=4) == pytest.approx(1.9375)
    assert _ngram(a, k=k).tokens_per_forward == pytest.approx(sum(a**i for i in range(k + 1)))
    assert Speculation(acceptance=a, num_tokens=k).tokens_per_forward == 1.0  # method none


@pytest.mark.parametrize(
    "kwargs",
    [
        {"acceptance": 1.2},
        {"acceptance": -0.1},
        {"num_tokens": 0},
        {"num_tokens": 17},
        {"max_num_seqs": 0},
        {"method": "draft"},
    ],
)
def test_out_of_range_speculation_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Speculation(**{"method": "ngram", **kwargs})  # type: ignore[arg-type]


def test_verification_forward_is_nearly_a_decode_step_at_batch_1(llama8b_h100: RooflineModel) -> None:
    plain = decode_step_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024)
    verify = verify_step_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024, num_tokens=4)
    assert plain < verify < 1.05 * plain  # weight-bound: five rows read the weights once, like one


def test_time_per_token_falls_at_batch_1_with_a_high_acceptance(llama8b_h100: RooflineModel) -> None:
    plain = decode_step_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024)
    spec = _ngram(0.8)
    per_token = decode_seconds_per_token(llama8b_h100, batch_size=1, num_context_tokens=1024, speculation=spec)
    assert per_token < plain / 3  # 3.36 tokens per forward for a forward that costs < 5 % more
    low = decode_seconds_per_token(llama8b_h100, batch_size=1, num_context_tokens=1024, speculation=_ngram(0.0))
    assert low > plain  # nothing accepted: only the extra rows' cost remains
    # the gap a client sees is a whole forward: longer than a plain step, not shorter
    assert decode_forward_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024, speculation=spec) > plain


def test_no_gain_at_large_batch(llama8b_h100: RooflineModel) -> None:
    ctx = 64 * 1024
    plain = decode_step_seconds(llama8b_h100, batch_size=64, num_context_tokens=ctx)
    ruled = decode_seconds_per_token(llama8b_h100, batch_size=64, num_context_tokens=ctx, speculation=_ngram(0.8))
    assert ruled == plain  # 64 > 16 decoding sequences: the rule turns speculation off
    lifted = _ngram(DEFAULT_ACCEPTANCE, limit=512)
    big = 256
    plain_big = decode_step_seconds(llama8b_h100, batch_size=big, num_context_tokens=big * 512)
    forced = decode_seconds_per_token(llama8b_h100, batch_size=big, num_context_tokens=big * 512, speculation=lifted)
    assert forced > 1.5 * plain_big  # 5 rows x 256 sequences are compute-bound: the rows cost more than they give


def test_capacity_uses_speculation_only_within_the_rule(llama8b_h100: RooflineModel) -> None:
    perf, ctx = llama8b_h100, 1500.0
    plain_tight = decode_capacity(perf, itl_seconds=0.0062, mean_context_tokens=ctx, max_num_seqs=256)
    spec_tight = decode_capacity(
        perf, itl_seconds=0.0062, mean_context_tokens=ctx, max_num_seqs=256, speculation=_ngram(0.7)
    )
    assert 0 < plain_tight.batch <= 16 and not plain_tight.speculating
    assert spec_tight.speculating and spec_tight.batch <= 16
    assert spec_tight.tokens_per_second > 1.5 * plain_tight.tokens_per_second
    plain_loose = decode_capacity(perf, itl_seconds=0.05, mean_context_tokens=ctx, max_num_seqs=256)
    spec_loose = decode_capacity(
        perf, itl_seconds=0.05, mean_context_tokens=ctx, max_num_seqs=256, speculation=_ngram(0.7)
    )
    assert plain_loose.batch > 16
    assert spec_loose == plain_loose  # the best batch is above the rule's limit: plain decode steps


def test_simulated_request_speeds_up_by_tokens_per_forward(llama8b_h100: RooflineModel) -> None:
    perf, spec = llama8b_h100, _ngram(0.8)
    requests = [Request(0, 0.0, 1000, 257)]

    def run(speculation: Speculation) -> tuple[float, float, float]:
        fleet = FleetConfig(mode=AGGREGATED, aggregated_replicas=1, engine=EngineSettings(speculation=speculation))
        r = simulate(fleet=fleet, perf=perf, requests=requests)
        return float(r.tpot_seconds[0]), r.itl_percentile(99), r.itl_percentile(50)

    plain_tpot, plain_p99, _ = run(Speculation())
    tpot, p99, p50 = run(spec)
    verify = verify_step_seconds(perf, batch_size=1, num_context_tokens=1128, num_tokens=4)
    assert tpot == pytest.approx(verify / spec.tokens_per_forward, rel=0.02)
    assert tpot < plain_tpot / 3
    assert p99 == pytest.approx(verify, rel=0.02) and p99 > plain_p99  # accepted tokens arrive together
    assert p50 == 0.0


def test_simulator_honours_the_batch_rule(llama8b_h100: RooflineModel) -> None:
    """40 identical requests decode together: above the limit of 16 nothing speculates (same
    result as off); with the limit at 64 every step does."""
    requests = [Request(i, 0.0, 200, 64) for i in range(40)]  # one prefill step: all decode together

    def tpot(speculation: Speculation, mode: str = AGGREGATED) -> float:
        counts = {"aggregated_replicas": 1} if mode == AGGREGATED else {"prefill_replicas": 1, "decode_replicas": 1}
        fleet = FleetConfig(mode=mode, engine=EngineSettings(speculation=speculation), **counts)  # type: ignore[arg-type]
        return float(simulate(fleet=fleet, perf=llama8b_h100, requests=requests).tpot_seconds.mean())

    off = tpot(Speculation())
    assert tpot(_ngram(0.8, limit=16)) == pytest.approx(off, rel=1e-9)
    assert tpot(_ngram(0.8, limit=64)) < off / 2
    assert tpot(_ngram(0.8, limit=64), DISAGGREGATED) < tpot(Speculation(), DISAGGREGATED) / 2  # decode pods too


def test_a_verification_forward_over_the_itl_slo_is_explained(llama8b_h100: RooflineModel) -> None:
    requests = [Request(i, 0.1 * i, 1024, 128) for i in range(20)]
    plain = decode_step_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024)
    verify = verify_step_seconds(llama8b_h100, batch_size=1, num_context_tokens=1024, num_tokens=16)
    slo = Slo(ttft_p99_seconds=1.0, itl_p99_seconds=(plain + verify) / 2)
    check_feasible(PlanInputs(perf=llama8b_h100, requests=requests, slo=slo))
    spec = EngineSettings(speculation=_ngram(0.5, k=16))
    with pytest.raises(PlanError, match="impossible ITL SLO with speculation"):
        check_feasible(PlanInputs(perf=llama8b_h100, requests=requests, slo=slo, engine=spec))


def test_cli_plans_with_speculation_and_writes_it_to_the_manifest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "isvc.yaml"
    code = main(
        [
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "H200",
            "--rate",
            "2",
            "--duration-s",
            "30",
            "--prompt-tokens",
            "lognormal:1024:0.5",
            "--output-tokens",
            "lognormal:256:0.5",
            "--ttft-p99-ms",
            "1000",
            "--itl-p99-ms",
            "20",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--spec-acceptance",
            "0.6",
            "--speculative-max-num-seqs",
            "8",
            "--emit-manifest",
            str(manifest),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "speculation ngram k=3, acceptance 0.6 (2.18 tokens/forward) at <= 8 decoding sequences" in out
    isvc = InferenceService.parse(yaml.safe_load(manifest.read_text()))
    spec = isvc.spec.scheduling_settings.speculative
    assert (spec.method, spec.num_tokens, spec.max_num_seqs, spec.draft_model) == ("ngram", 3, 8, None)
    main(["--rate", "2", "--duration-s", "30", "--emit-manifest", str(manifest)])
    assert "speculative" not in yaml.safe_load(manifest.read_text())["spec"]["scheduling"]  # off: left out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--speculative", "ngram", "--spec-acceptance", "1.5"), "--spec-acceptance must be in [0, 1], got 1.5"),
        (("--speculative", "ngram", "--num-speculative-tokens", "0"), "--num-speculative-tokens must be in [1, 16]"),
        (("--speculative", "ngram", "--speculative-max-num-seqs", "0"), "--speculative-max-num-seqs must be >= 1"),
    ],
)
def test_cli_bad_speculation_exits_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    assert main(["--rate", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_method_it_cannot_price(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rate", "1", "--speculative", "draft"])
    assert exc.value.code == 2
    assert "invalid choice: 'draft'" in capsys.readouterr().err


def test_macro_steps_agree_with_one_event_per_step_when_speculating(llama8b_h100: RooflineModel) -> None:
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=6),
        prompt_tokens=LengthDist.parse("lognormal:1024:0.8"),
        output_tokens=LengthDist.parse("lognormal:128:0.8"),
    )
    requests = spec.generate(duration_seconds=30, seed=0)
    fleet = FleetConfig(
        mode=DISAGGREGATED, prefill_replicas=1, decode_replicas=1, engine=EngineSettings(speculation=_ngram(0.6))
    )
    fast = simulate(fleet=fleet, perf=llama8b_h100, requests=requests, options=SimOptions(macro_steps=True))
    slow = simulate(fleet=fleet, perf=llama8b_h100, requests=requests, options=SimOptions(macro_steps=False))
    assert fast.num_events < slow.num_events / 2
    for q in (50, 90, 99):
        assert fast.e2e_percentile(q) == pytest.approx(slow.e2e_percentile(q), rel=0.02)
        assert fast.itl_percentile(q) == pytest.approx(slow.itl_percentile(q), rel=0.02, abs=1e-6)
