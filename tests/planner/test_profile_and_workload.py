"""Profiles (schema, validation messages, the fit) and workloads (coupling, MMPP, traces)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from splitserve_planner.profile import (
    ProfileError,
    ProfileModel,
    load_profile,
    save_profile,
    shipped_profiles,
)
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec, load_trace


def _synthetic_profile() -> dict[str, Any]:
    def step(tokens: int, seqs: int, pairs: int, kv: int) -> float:  # a known linear truth
        return 1e-3 + 2e-6 * tokens + 5e-5 * seqs + 1e-9 * pairs + 3e-8 * kv

    prefill = [
        {
            "numSeqs": s,
            "numTokens": t,
            "numCachedTokens": c,
            "seconds": step(s * t, s, s * (t * c + t * (t + 1) // 2), s * c),
        }
        for s in (1, 4)
        for t in (64, 256, 1024)
        for c in (0, 128)
    ]
    decode = [
        {"batchSize": b, "numContextTokens": b * c, "seconds": step(b, b, b * c + b, b * c)}
        for b in (1, 8, 64)
        for c in (128, 1024)
    ]
    return {
        "schemaVersion": 1,
        "kind": "PerfProfile",
        "model": {
            "name": "synthetic",
            "numLayers": 2,
            "hiddenSize": 64,
            "numKvHeads": 2,
            "headDim": 16,
            "vocabSize": 512,
        },
        "device": "test",
        "dtype": "float32",
        "kvBytesPerToken": 512,
        "kvCapacityTokens": 32768,
        "engine": {"maxNumSeqs": 64, "maxBatchedTokens": 4096, "blockSize": 16},
        "prefill": prefill,
        "decode": decode,
    }


def test_fit_recovers_a_linear_truth_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_synthetic_profile()))
    profile = load_profile(path=path)
    model = ProfileModel(profile=profile)
    assert model.fit_errors()["max_relative_error"] < 1e-6
    assert model.step_seconds(
        num_tokens=100, num_seqs=10, num_attention_pairs=5000, num_kv_tokens=4000
    ) == pytest.approx(1e-3 + 2e-4 + 5e-4 + 5e-6 + 1.2e-4, rel=1e-6)
    again = tmp_path / "again.json"
    save_profile(profile=profile, path=again)
    assert load_profile(path=again) == profile
    as_yaml = tmp_path / "p.yaml"
    as_yaml.write_text(yaml.safe_dump(_synthetic_profile()))
    assert load_profile(path=as_yaml) == profile


def test_jitter_keeps_the_mean_and_is_seeded(tmp_path: Path) -> None:
    raw = _synthetic_profile()
    raw["decode"][0]["seconds"] *= 3  # some noise to resample
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    profile = load_profile(path=path)

    def draws(seed: int) -> list[float]:
        m = ProfileModel(profile=profile, jitter_seed=seed)
        return [
            m.step_seconds(num_tokens=8, num_seqs=8, num_attention_pairs=1000, num_kv_tokens=992) for _ in range(4000)
        ]

    plain = ProfileModel(profile=profile).step_seconds(
        num_tokens=8, num_seqs=8, num_attention_pairs=1000, num_kv_tokens=992
    )
    assert draws(1) == draws(1) != draws(2)
    assert float(np.mean(draws(1))) == pytest.approx(plain, rel=0.05)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("model"), "model: Field required"),
        (lambda d: d["prefill"][0].update(seconds=-1), "prefill.0.seconds: Input should be greater than 0"),
        (lambda d: d.update(extra=1), "extra: unknown field"),
        (lambda d: d.update(decode=d["decode"][:1]), "decode: List should have at least 2 items"),
        (lambda d: d.update(schemaVersion=2), "schemaVersion must be 1, got 2"),
    ],
)
def test_bad_profiles_name_the_problem(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    raw = _synthetic_profile()
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="bad.json") as exc:
        load_profile(path=path)
    assert message in str(exc.value)


def test_shipped_cpu_profile_loads() -> None:
    names = [p.name for p in shipped_profiles()]
    assert "cpu-tiny-llama.json" in names
    for path in shipped_profiles():
        model = ProfileModel(profile=load_profile(path=path))
        assert model.fit_errors()["median_relative_error"] < 0.5


def _spec(rate: float, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate, **kw),
        prompt_tokens=LengthDist.parse("lognormal:512:1"),
        output_tokens=LengthDist.parse("exponential:128"),
        prefix_share=0.5,
        prefix_tokens=256,
    )


def test_workloads_are_coupled_across_rates_and_seeded() -> None:
    slow = _spec(10).generate(duration_seconds=100, seed=4)
    fast = _spec(20).generate(duration_seconds=50, seed=4)
    assert len(slow) == len(fast)
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.prefix_group) for r in slow] == [
        (r.num_prompt_tokens, r.num_output_tokens, r.prefix_group) for r in fast
    ]
    assert all(a.arrival_seconds == pytest.approx(2 * b.arrival_seconds) for a, b in zip(slow, fast, strict=True))
    assert len(slow) == pytest.approx(1000, rel=0.1)
    assert _spec(10).generate(duration_seconds=10, seed=5)[3] != _spec(10).generate(duration_seconds=10, seed=6)[3]


def test_bursty_arrivals_keep_the_mean_rate_and_are_burstier() -> None:
    poisson = _spec(10).generate(duration_seconds=4000, seed=1)
    bursty = _spec(10, kind="bursty", burst_factor=5, burst_seconds=20).generate(duration_seconds=4000, seed=1)
    assert len(bursty) == pytest.approx(len(poisson), rel=0.1)

    def dispersion(requests: list[Request]) -> float:  # variance/mean of counts per 10 s window (1 for Poisson)
        counts = np.bincount([int(r.arrival_seconds // 10) for r in requests])
        return float(counts.var() / counts.mean())

    assert dispersion(poisson) == pytest.approx(1.0, abs=0.3)
    assert dispersion(bursty) > 5


def test_trace_replay(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "timestamp,prompt_tokens,output_tokens,prefix_group,prefix_tokens\n"
        "10.5,300,20,,\n10.0,200,10,3,128\n11.0,100,5,3,\n"
    )
    requests = load_trace(path=path, default_prefix_tokens=64)
    assert [r.arrival_seconds for r in requests] == [0.0, 0.5, 1.0]
    assert [(r.num_prompt_tokens, r.prefix_group, r.num_prefix_tokens) for r in requests] == [
        (200, 3, 128),
        (300, -1, 0),
        (100, 3, 64),
    ]
    path.write_text("timestamp,prompt_tokens,output_tokens\n1,0,5\n")
    with pytest.raises(ValueError, match="line 2: timestamp must be >= 0 and token counts >= 1"):
        load_trace(path=path)
