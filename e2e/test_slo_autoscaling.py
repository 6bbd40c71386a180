"""SLO autoscaling end to end: ``spec.autoscaling.slo`` scales the pool the SLO needs.

The operator is installed by its chart (a container from the image built from this tree,
reading the harness's Prometheus), the InferenceService runs the tiny model on CPU in
containers on the kubelet node, and load goes through the router, as in
``test_autoscaling``. Target tracking is disarmed (its targets set out of reach, so its
floors stay at ``min``): whatever moves a pool here is the SLO controller.

CPU pods' speed depends on the machine, so the SLO is not a constant: the scenario first
measures the pools' p99 TTFT and ITL under a quiet load (one stream at a time) from
Prometheus, with the operator's own query, then sets the SLO to a few times those figures
(:data:`TTFT_SLO_FACTOR`, :data:`ITL_SLO_FACTOR`). Then, in this order:

1. TTFT step: many concurrent long prompts with one output token each queue on the prefill
   pod, so TTFT misses while decoding has nothing to do: the prefill pool scales up, the
   decode pool does not.
2. ITL step: a full decode batch of streams with short prompts and long outputs. Decode steps
   grow with the batch, so ITL misses the SLO: the decode pool scales up. The prefill pool
   may follow only on its own metric: on these CPU pods the decode batch slows the prefill
   pod too (they share the cores) and the TTFT of requests waiting for a decode slot is
   measured as well, so TTFT can miss during this step (0.84 s against 0.81 s in one run);
   a prefill scale-up here must then be a measured-TTFT violation.
3. A trickle one pod of each pool serves well within the SLO, then no load: every decision is
   an explained SLO decision whose model says one pod suffices, and both pools return to
   ``min``. The controller scales down on its model only at a confidence of 0.5, and on these
   CPU pods the fits' relative error (0.2-0.55) keeps it below that, so the way down is its
   measured-evidence rule (an idle pool, or a p99 far below target).

One module-scoped scenario (:func:`scenario`) runs it; the tests read what it recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import Reason
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import (
    LoadBurst,
    PoolSample,
    get_isvc,
    router_endpoints,
    sample_pools,
    wait_ready,
)
from splitserve_e2e.demo import apply_object as apply
from splitserve_e2e.stack import ModelHub, isvc_manifest, operator_namespace
from splitserve_operator.autoscaler.signals import pool_selector
from splitserve_operator.autoscaler.slo.measure import latency_quantile_promql

pytestmark = pytest.mark.e2e

PREFILL = contract.Role.PREFILL.value
DECODE = contract.Role.DECODE.value
ROLES = (PREFILL, DECODE)
NAME = "slo"
INTERVAL_SECONDS = 5
DOWN_STABILIZATION_SECONDS = 15
MAX_REPLICAS = 2
TTFT_SLO_FACTOR = 4.0
ITL_SLO_FACTOR = 3.0
"""The SLO is these many times the quiet p99s: loose enough that one pod of each pool meets it
under a trickle, tight enough that a prompt queue (TTFT) or a full decode batch (ITL) misses
it. On the shared 2-core test machine the quiet p99s themselves vary 3x between runs
(TTFT 59 ms vs 203 ms for the same prompts), so the factors leave room for that noise."""
QUIET_SECONDS = 40.0
"""Longer than the operator's signal window (30 s), so its quantiles see only quiet load."""
PROMPT_WORDS = 150  # ~400 tokens of the 1024 context: the work of a request is its prefill
TTFT_CONCURRENCY = 16
ITL_CONCURRENCY = 16  # = engine.maxNumSeqs of the tiny example
PHASE_SECONDS = 90.0
TRICKLE_SECONDS = 45.0
"""A trickle: every decision during it must be an explained SLO decision whose model says one
pod of each pool suffices."""
IDLE_SECONDS = 100.0
"""Then no load: enough for both pools to come down, the 30 s signal window (the load's p99 must
leave it), then the 15 s scale-down stabilization. A fit of low confidence (these noisy CPU pods
keep it below 0.5) steps down on measurements alone: an idle pool, or a p99 far below target."""
ITL, TTFT, TRICKLE = "itl", "ttft", "trickle"
CPU_PRIOR = {"step": 2e-3, "prefillToken": 2e-5, "prefillPair": 1e-7, "decodeRow": 2e-4, "decodeContext": 1e-7}
"""The starting model, as ``splitserve plan --slo`` writes one for a GPU (its roofline has no
CPU): the order of the tiny model's step costs on these CPU pods (what this test's fits
converged to in earlier runs), the fits pull it to the pods' own. Without a prior the decode fit
learns from the quiet stream's batch-1 steps alone, which cannot split a step's fixed cost from
its per-row cost; it used to price all of it per row, read a decode pod's capacity as ~400
rows/s (the pod batches 16 streams in about the time of one) and, at the quiet stream's 20 req/s
of 15-token outputs ÷ 0.8, scaled the decode pool on the forecast in 2 of 4 runs. A prior-less
fit now puts that split on the step and reads its confidence at the planned mix
(:mod:`splitserve_operator.autoscaler.slo.step_fit`); this test without the prior passed 3 of 3
runs so (2026-12-05), but it checks the scaling, not the learning, so it keeps a prior."""
LOOSE_SLO = {"ttftP99": "60s", "itlP99": "10s", "attainment": 0.99, "headroom": 0.8, "prior": CPU_PRIOR}
SLO_REASONS = {r for r in vars(Reason).values() if isinstance(r, str) and r.startswith("Slo")}


@dataclasses.dataclass
class Phase:
    """One load step: the load, its wall-clock window, the worst p99s Prometheus showed during it
    (the operator's query over its 30 s window) and the status right after it."""

    load: LoadBurst
    window: tuple[float, float] = (0.0, 0.0)
    peak_ttft: float = math.nan
    peak_itl: float = math.nan
    scaled_after: float = math.nan
    """Seconds from the load's start to the first sample with the scaled pool's replicas > 1."""
    isvc: dict[str, Any] = dataclasses.field(default_factory=dict)
    isvc_at_scale: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The InferenceService as first read after the scaled pool's desired replicas rose above 1:
    its ``recentDecisions`` still hold that scale-up. By the phase's end a pool at its maximum
    may have made five other distinct decisions (SloViolated at max, SloMet, Stabilizing ...),
    which push it out of that five-entry list; ``scalingHistory`` keeps it, without the formula."""


@dataclasses.dataclass
class Scenario:
    """What the scenario measured and saw."""

    quiet_ttft: float = math.nan
    quiet_itl: float = math.nan
    slo: dict[str, Any] = dataclasses.field(default_factory=dict)
    phases: dict[str, Phase] = dataclasses.field(default_factory=dict)
    samples: list[tuple[float, dict[str, PoolSample]]] = dataclasses.field(default_factory=list)
    isvc: dict[str, Any] = dataclasses.field(default_factory=dict)
    slo_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def desired(self, role: str, phase: str) -> list[int]:
        start, end = self.phases[phase].window
        return [pools[role].desired for t, pools in self.samples if start <= t <= end]

    def target(self, key: str) -> float:
        return float(str(self.slo[key]).removesuffix("ms")) / 1000

    def history(self, pool: str, phase: str) -> list[dict[str, Any]]:
        """``status.scalingHistory`` entries of ``pool`` written during ``phase``. The status
        stamps whole seconds, rounded down, so the window's bounds are too (no slack beyond
        that: the next phase starts within a second or two, and its first scale-up must not
        count as this one's)."""
        start, end = self.phases[phase].window
        return [
            e for e in _history(self.isvc, pool=pool) if math.floor(start) <= _parse_time(e["time"]) <= math.floor(end)
        ]


def _parse_time(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def _history(isvc: dict[str, Any], *, pool: str) -> list[dict[str, Any]]:
    return [e for e in (isvc.get("status") or {}).get("scalingHistory") or [] if e.get("pool") == pool]


def _quantile(cluster: LocalCluster, *, ns: str, metric: str, window_seconds: float) -> float:
    """The worse pool's p99 of ``metric`` over the window, each pool's buckets summed over its
    pods: what the operator reads (and, for TTFT, acts on) with the same query."""
    values: list[float] = []
    for role in ROLES:
        selector = pool_selector(namespace=ns, inferenceservice=NAME, role=role)
        result = cluster.query(
            latency_quantile_promql(metric=metric, selector=selector, quantile=0.99, window_seconds=window_seconds)
        )
        values += [float(r["value"][1]) for r in result]
    return max((v for v in values if math.isfinite(v)), default=math.nan)


def _with_slo(manifest: dict[str, Any], slo: dict[str, Any]) -> dict[str, Any]:
    manifest["spec"]["autoscaling"]["slo"] = dict(slo)
    return manifest


def _duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds * 1000))}ms"


# --------------------------------------------------------------------------- the scenario
@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    if not cluster.prometheus_url:
        pytest.fail("the SLO autoscaling e2e test needs the cluster's Prometheus")
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="e2e-slo") as name:
        yield name


async def _status_with_the_scale_up(cluster: LocalCluster, ns: str, pool: str) -> dict[str, Any]:
    """The InferenceService once its status shows the scale-up of ``pool`` (bounded): the
    autoscaler applies the replicas first and writes the decision to status just after, so a
    read the moment the Deployment's replicas rise can still hold the round before (CI, loaded)."""
    deadline = time.monotonic() + 30
    while True:
        isvc = await asyncio.to_thread(get_isvc, cluster=cluster, namespace=ns, name=NAME)
        decisions = ((isvc.get("status") or {}).get(pool) or {}).get("recentDecisions") or []
        if any(d["to"] > d["from"] for d in decisions) or time.monotonic() > deadline:
            return isvc
        await asyncio.sleep(0.5)


async def _run_phase(
    cluster: LocalCluster, ns: str, out: Scenario, name: str, load: LoadBurst, *, scales: str | None
) -> None:
    """Run ``load`` until the ``scales`` pool has had a second Ready pod for a few rounds (the
    other pool must not follow), or, with ``scales`` None, until both pools are at ``min``."""
    phase = out.phases[name] = Phase(load=load)
    start = time.time()
    task = asyncio.create_task(load.run())
    scaled_at: float | None = None
    while not task.done():
        pools = await asyncio.to_thread(sample_pools, cluster=cluster, namespace=ns, name=NAME, roles=ROLES)
        now = time.time()
        out.samples.append((now, pools))
        for metric, attr in (
            (contract.Metric.TIME_TO_FIRST_TOKEN_SECONDS, "peak_ttft"),
            (contract.Metric.INTER_TOKEN_LATENCY_SECONDS, "peak_itl"),
        ):
            value = await asyncio.to_thread(_quantile, cluster, ns=ns, metric=metric, window_seconds=30)
            if math.isfinite(value):
                setattr(phase, attr, max(value, getattr(phase, attr)) if math.isfinite(getattr(phase, attr)) else value)
        if scales is None:
            if all(pools[r].desired == 1 and pools[r].ready == 1 for r in ROLES):
                break
        else:
            if math.isnan(phase.scaled_after) and pools[scales].desired > 1:
                phase.scaled_after = now - start
                phase.isvc_at_scale = await _status_with_the_scale_up(cluster, ns, scales)
            if scaled_at is None and pools[scales].ready >= 2:
                scaled_at = now
            if scaled_at is not None and now - scaled_at > 3 * INTERVAL_SECONDS:
                break
        await asyncio.sleep(2)
    load.stop()
    await task
    if scales is None:  # then no request at all, until both pools are at min
        idle_until = time.time() + IDLE_SECONDS
        while time.time() < idle_until:
            pools = await asyncio.to_thread(sample_pools, cluster=cluster, namespace=ns, name=NAME, roles=ROLES)
            out.samples.append((time.time(), pools))
            if all(pools[r].desired == 1 and pools[r].ready == 1 for r in ROLES):
                break
            await asyncio.sleep(2)
    phase.window = (start, time.time())
    out.seconds[name] = time.time() - start
    phase.isvc = await asyncio.to_thread(get_isvc, cluster=cluster, namespace=ns, name=NAME)


async def _drive(cluster: LocalCluster, ns: str, endpoint: str, out: Scenario) -> None:
    base_url = f"http://{endpoint}/v1"
    # TTFT: many concurrent long prompts, one output token: prompts queue on the prefill pod
    await _run_phase(
        cluster,
        ns,
        out,
        TTFT,
        LoadBurst(
            base_url=base_url,
            concurrency=TTFT_CONCURRENCY,
            duration_seconds=PHASE_SECONDS,
            prompt_words=PROMPT_WORDS,
            max_tokens=1,
        ),
        scales=PREFILL,
    )
    # ITL: as many streams as a decode pod batches (more would queue for a slot and show up
    # as TTFT), prompts short but above the router's straight-to-decode threshold, long outputs
    await _run_phase(
        cluster,
        ns,
        out,
        ITL,
        LoadBurst(
            base_url=base_url,
            concurrency=ITL_CONCURRENCY,
            duration_seconds=PHASE_SECONDS,
            prompt_words=8,
            max_tokens=96,
        ),
        scales=DECODE,
    )
    # a trickle one pod of each pool serves well within the SLO
    await _run_phase(
        cluster,
        ns,
        out,
        TRICKLE,
        LoadBurst(base_url=base_url, concurrency=1, duration_seconds=TRICKLE_SECONDS, prompt_words=20, max_tokens=8),
        scales=None,
    )


@pytest.fixture(scope="module")
def scenario(cluster: LocalCluster, ns: str, model_hub: ModelHub) -> Scenario:
    out = Scenario()
    began = time.time()
    # target tracking out of reach: its floors stay at min, the SLO alone scales
    manifest = isvc_manifest(
        name=NAME,
        namespace=ns,
        mode="Disaggregated",
        hub=model_hub,
        interval=f"{INTERVAL_SECONDS}s",
        max_replicas=MAX_REPLICAS,
        scale_down_stabilization_seconds=DOWN_STABILIZATION_SECONDS,
        prefill_target_queue_depth=1000.0,
        decode_target_queue_depth=1000.0,
        decode_target_kv=1.0,
    )
    apply(cluster=cluster, obj=_with_slo(manifest, LOOSE_SLO))
    wait_ready(cluster=cluster, namespace=ns, name=NAME, timeout_seconds=240)
    out.seconds["ready"] = time.time() - began
    endpoint = router_endpoints(cluster=cluster, namespace=ns, name=NAME)[0]

    # measure: one stream at a time, the load step's prompts, a few output tokens for ITL
    quiet = LoadBurst(
        base_url=f"http://{endpoint}/v1",
        concurrency=1,
        duration_seconds=QUIET_SECONDS,
        prompt_words=PROMPT_WORDS,
        max_tokens=16,
    )
    asyncio.run(quiet.run())
    time.sleep(3)  # one more scrape
    assert quiet.failed == 0 and quiet.ok >= 5, (quiet.ok, quiet.errors()[:3])
    out.quiet_ttft = _quantile(
        cluster, ns=ns, metric=contract.Metric.TIME_TO_FIRST_TOKEN_SECONDS, window_seconds=QUIET_SECONDS
    )
    out.quiet_itl = _quantile(
        cluster, ns=ns, metric=contract.Metric.INTER_TOKEN_LATENCY_SECONDS, window_seconds=QUIET_SECONDS
    )
    assert math.isfinite(out.quiet_ttft) and math.isfinite(out.quiet_itl), (out.quiet_ttft, out.quiet_itl)
    out.slo = {
        **LOOSE_SLO,
        "ttftP99": _duration(TTFT_SLO_FACTOR * out.quiet_ttft),
        "itlP99": _duration(ITL_SLO_FACTOR * out.quiet_itl),
    }
    apply(cluster=cluster, obj=_with_slo(manifest, out.slo))
    out.seconds["measure"] = time.time() - began - out.seconds["ready"]

    asyncio.run(_drive(cluster, ns, endpoint, out))
    out.isvc = get_isvc(cluster=cluster, namespace=ns, name=NAME)
    config_map: Any = cluster.core().read_namespaced_config_map(f"{NAME}-slo-state", ns)
    out.slo_state = json.loads((config_map.data or {})["state.json"])
    out.seconds["total"] = time.time() - began
    _report(out)
    return out


def _report(out: Scenario) -> None:
    print(
        f"\nSLO e2e: quiet p99 TTFT {out.quiet_ttft:.4f}s ITL {out.quiet_itl:.4f}s -> slo {out.slo}; "
        f"seconds {json.dumps({k: round(v) for k, v in out.seconds.items()})}"
    )
    for name, phase in out.phases.items():
        print(
            f"  {name}: ok/failed {phase.load.ok}/{phase.load.failed}, peak p99 TTFT {phase.peak_ttft:.3f}s "
            f"ITL {phase.peak_itl:.4f}s, scaled after {phase.scaled_after:.0f}s"
        )
        for pool in ROLES:
            decision = ((phase.isvc.get("status") or {}).get(pool) or {}).get("lastDecision") or {}
            print(f"    {pool}: {decision.get('reason')} {decision.get('inputs')} model {decision.get('model')}")
        for entry in ((phase.isvc_at_scale.get("status") or {}).get(DECODE) or {}).get("recentDecisions") or []:
            print(f"    decode at scale-up: {entry.get('reason')} {entry.get('formula')}")
    print(f"  scalingHistory: {(out.isvc.get('status') or {}).get('scalingHistory')}")
    for pool, fit in out.slo_state.get("fits", {}).items():
        print(f"  fit {pool}: points {fit.get('points')} confidence {fit.get('confidence')} {fit.get('coefficients')}")


# --------------------------------------------------------------------------- the tests
ALLOWED_UP_REASONS = SLO_REASONS | {Reason.SCALED_UP, Reason.AT_MAX_REPLICAS}
"""A scale-up is the SLO controller's: an Slo* reason, or a limit it ran into (AtMaxReplicas),
or ScaledUp (a model count the controller had no more specific reason for)."""
LIMIT_REASONS = {Reason.SCALED_DOWN, Reason.STABILIZING, Reason.AT_MIN_REPLICAS, Reason.AT_MAX_REPLICAS}


def test_ttft_violation_scales_prefill_and_not_decode(scenario: Scenario) -> None:
    phase = scenario.phases[TTFT]
    assert max(scenario.desired(PREFILL, TTFT)) > 1, (phase.peak_ttft, scenario.slo, scenario.samples)
    decode_decisions = [
        ((isvc.get("status") or {}).get(DECODE) or {}).get("recentDecisions")
        for isvc in (phase.isvc_at_scale, phase.isvc)
    ]
    assert set(scenario.desired(DECODE, TTFT)) == {1}, (decode_decisions, scenario.samples)
    assert not [e for e in scenario.history(DECODE, TTFT) if e["to"] > e["from"]], scenario.isvc["status"]
    assert phase.peak_ttft > scenario.target("ttftP99"), (phase.peak_ttft, scenario.slo)
    assert phase.load.ok > 0, phase.load.errors()[:5]


def test_itl_violation_scales_decode_and_prefill_only_on_its_own_metric(scenario: Scenario) -> None:
    phase = scenario.phases[ITL]
    assert max(scenario.desired(DECODE, ITL)) > 1, (phase.peak_itl, scenario.slo, scenario.samples)
    # the prefill pool's only signal is TTFT: a scale-up of it now is a measured TTFT miss
    prefill_ups = [e for e in scenario.history(PREFILL, ITL) if e["to"] > e["from"]]
    assert all(e["reason"] == Reason.SLO_VIOLATED for e in prefill_ups), prefill_ups
    if prefill_ups:
        assert phase.peak_ttft > scenario.target("ttftP99"), (phase.peak_ttft, scenario.slo)
    # decode grew because ITL missed, or ahead of the miss on its fitted model (the forecast)
    decode_ups = [e for e in scenario.history(DECODE, ITL) if e["to"] > e["from"]]
    model_driven = any(e["reason"] != Reason.SLO_VIOLATED for e in decode_ups)
    assert model_driven or phase.peak_itl > scenario.target("itlP99"), (phase.peak_itl, scenario.slo, decode_ups)
    assert phase.load.ok > 0 and phase.load.failed == 0, phase.load.errors()[:5]


@pytest.mark.parametrize(("pool", "name", "metric"), [(PREFILL, TTFT, "ttftP99"), (DECODE, ITL, "itlP99")])
def test_scale_ups_are_slo_decisions_explained_in_status(scenario: Scenario, pool: str, name: str, metric: str) -> None:
    ups = [e for e in scenario.history(pool, name) if e["to"] > e["from"]]
    assert ups, scenario.isvc["status"].get("scalingHistory")
    assert all(e["reason"] in ALLOWED_UP_REASONS for e in ups), ups
    assert any(e["reason"] in SLO_REASONS for e in ups), ups
    status = scenario.phases[name].isvc["status"][pool]
    at_scale = scenario.phases[name].isvc_at_scale["status"][pool]
    up_decisions = [d for d in at_scale["recentDecisions"] if d["to"] > d["from"]]
    assert up_decisions, at_scale["recentDecisions"]
    for decision in up_decisions:
        formula = decision["formula"]
        assert formula.startswith("slo ttft"), formula
        # why: the measured p99 over its target, or the fitted model's estimate
        assert f"measured {metric}" in formula or "fewest N meeting" in formula or "no N ≤" in formula, formula
    inputs = status["lastDecision"]["inputs"]
    assert inputs[f"{metric}Target"] == pytest.approx(scenario.target(metric), rel=1e-3), inputs
    other = "itlP99" if metric == "ttftP99" else "ttftP99"
    assert metric in inputs and f"{other}Target" not in inputs, inputs  # each pool its own metric


def test_fitted_model_is_in_status_and_in_the_state_config_map(scenario: Scenario) -> None:
    for pool in ROLES:
        model = scenario.isvc["status"][pool]["lastDecision"].get("model") or {}
        assert model.get("points", 0) > 0, (pool, model)
        assert 0.0 <= model["confidence"] <= 1.0, model
        assert "requestRate" in model, (pool, model)  # 0 by now: the scenario ends idle
        under_load = scenario.phases[ITL].isvc["status"][pool]["lastDecision"].get("model") or {}
        assert under_load.get("requestRate", 0) > 0, (pool, under_load)
    fits = scenario.slo_state["fits"]
    assert set(fits) >= set(ROLES), fits.keys()
    for pool in ROLES:
        assert fits[pool]["points"] > 0, fits[pool]
        coefficients = fits[pool]["coefficients"]
        assert coefficients and all(v >= 0 for v in coefficients.values()), fits[pool]
    # the prefill pod computed the prompts: its fit prices them; the decode pod's, its rows
    prefill, decode = fits[PREFILL]["coefficients"], fits[DECODE]["coefficients"]
    assert prefill["prefill_token"] > 0 or prefill["prefill_pair"] > 0, prefill
    assert decode["decode_row"] > 0 or decode["decode_context"] > 0 or decode["step"] > 0, decode
    # the pod start time the forecast horizon uses was measured on a real scale-up
    assert scenario.slo_state["startSeconds"].get(PREFILL, 0) > 0, scenario.slo_state["startSeconds"]


def test_after_the_load_every_decision_is_an_explained_slo_decision(scenario: Scenario) -> None:
    phase = scenario.phases[TRICKLE]
    for pool in ROLES:
        last = scenario.isvc["status"][pool]["lastDecision"]
        assert last["reason"] in SLO_REASONS | LIMIT_REASONS, last
        assert last["formula"].startswith("slo ttft"), last
        model = last.get("model") or {}
        assert model.get("points", 0) > 0 and "modelReplicas" in model, last
        # the model: one pod of each pool serves the trickle
        assert model["modelReplicas"] == 1, last
    assert phase.load.ok >= 3 and phase.load.failed == 0, (phase.load.ok, phase.load.errors()[:5])


def test_both_pools_return_to_min_after_the_load(scenario: Scenario) -> None:
    final = scenario.samples[-1][1]
    assert all(final[r].desired == 1 and final[r].ready == 1 for r in ROLES), (
        final,
        {p: scenario.isvc["status"][p]["lastDecision"]["formula"] for p in ROLES},
    )
    for pool in ROLES:
        downs = [e for e in scenario.history(pool, TRICKLE) if e["to"] < e["from"]]
        assert downs and all(e["reason"] == Reason.SCALED_DOWN for e in downs), _history(scenario.isvc, pool=pool)
