"""SLO autoscaling rounds end to end in memory: :func:`run_once` with ``spec.autoscaling.slo``
against a fake Prometheus (answering the queries of :mod:`splitserve_operator.autoscaler.signals`
from per-pod tables) and the in-memory API server of :mod:`kube_testing`.

What is checked: the SLO decision is written (replicas and ``lastDecision.model``), target
tracking's counts are floors, the controller's state goes to the ``<isvc>-slo-state``
ConfigMap (owned by the InferenceService, not controlled by it) and a fresh store (an operator
restart) reads it back, dry run computes and reports without writes, a missing load holds
with ``MetricsHealthy=False``, and the signal queries pin live pods and compute what the
controller needs.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import Mapping
from typing import Any, cast

import pytest
from kube_testing import FakeKube, record_events
from prometheus_client import CollectorRegistry

import splitserve_contract as contract
from splitserve_contract import Metric, Reason
from splitserve_operator import kube, naming
from splitserve_operator.autoscaler.decision import MetricsUnavailable
from splitserve_operator.autoscaler.loop import run_once
from splitserve_operator.autoscaler.memory import AutoscalerState
from splitserve_operator.autoscaler.metrics import AutoscalerMetrics
from splitserve_operator.autoscaler.signals import PoolSample
from splitserve_operator.autoscaler.slo import store as store_module
from splitserve_operator.autoscaler.slo.inputs import StepCoefficients
from splitserve_operator.autoscaler.slo.measure import (
    DECODE_ONLY_COUNTERS,
    fetch_load,
    fetch_pool_slo,
    fetch_step_samples,
)
from splitserve_operator.autoscaler.slo.state import SloState
from splitserve_operator.autoscaler.slo.store import SloStore
from splitserve_operator.naming import slo_state_config_map_name
from splitserve_operator.status import merge_patch

NS = "ns"
NAME = "svc"
NOW = 1_800_000_000.0
PRIOR = StepCoefficients(step=0.004, prefill_token=5e-5, prefill_pair=1e-9, decode_row=2e-4, decode_context=1e-7)
ENGINE = (
    Metric.ENGINE_STEPS_TOTAL,
    Metric.ENGINE_STEP_SECONDS_TOTAL,
    Metric.ENGINE_PREFILL_TOKENS_TOTAL,
    Metric.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL,
    Metric.ENGINE_DECODE_ROWS_TOTAL,
    Metric.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL,
)


# --------------------------------------------------------------------------- fakes
class FakePrometheus:
    """Answers the autoscaler's instant queries from tables.

    ``pods[pod][metric]``: a pod's gauge (any ``avg_over_time``/plain read), or for an engine
    counter its increase over the window; ``roles[pod]``: its role; ``pool[role][name]``: a
    pool-wide value (``ttft``, ``itl`` quantiles, ``rate:<metric>`` sums). A query only sees
    the pods its ``pod=~`` matcher names, as Prometheus would."""

    url = "http://prometheus.test"

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, float]] = {}
        self.roles: dict[str, str] = {}
        self.pool: dict[str, dict[str, float]] = {}
        self.queries: list[str] = []
        self.failing: set[str] = set()
        """Metric names whose queries return nothing."""

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.queries.append(query)
        role = re.search(r'role="(\w+)"', query)
        pods_matcher = re.search(r'pod=~"([^"]*)"', query)
        wanted = set(pods_matcher.group(1).replace("\\", "").split("|")) if pods_matcher else None
        pods = [p for p, r in self.roles.items() if role and r == role.group(1) and (wanted is None or p in wanted)]
        metric = next((m for m in sorted(self._known(), key=len, reverse=True) if m in query), "")
        if metric in self.failing:
            return []
        if query.startswith("histogram_quantile"):
            name = "ttft" if metric.startswith(Metric.TIME_TO_FIRST_TOKEN_SECONDS) else "itl"
            return self._single(self.pool.get(role.group(1) if role else "", {}).get(name))
        if query.startswith("sum(rate("):
            return self._single(self.pool.get(role.group(1) if role else "", {}).get(f"rate:{metric}"))
        if "timestamp(" in query:
            return [self._series(p, float((params or {}).get("time", NOW))) for p in pods]
        return [self._series(p, self.pods[p][metric]) for p in pods if metric in self.pods[p]]

    def _known(self) -> set[str]:
        names = {m for values in self.pods.values() for m in values}
        names |= {k.removeprefix("rate:") for values in self.pool.values() for k in values}
        return names | {Metric.TIME_TO_FIRST_TOKEN_SECONDS, Metric.INTER_TOKEN_LATENCY_SECONDS}

    @staticmethod
    def _series(pod: str, value: float) -> dict[str, Any]:
        return {"metric": {"pod": pod}, "value": [NOW, str(value)]}

    @staticmethod
    def _single(value: float | None) -> list[dict[str, Any]]:
        return [] if value is None else [{"metric": {}, "value": [NOW, str(value)]}]


class SelectingKube:
    """:class:`FakeKube` whose pod list honours the label selector (two pools share it)."""

    def __init__(self) -> None:
        self.fake = FakeKube()
        self.gets: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    def get(self, *, kind: kube.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.gets.append((kind.kind, name))
        found: dict[str, Any] | None = self.fake.get(kind=kind, namespace=namespace, name=name)
        return found

    def merge_patch(
        self,
        *,
        kind: kube.Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch at every depth (RFC 7386), as the API server applies one."""
        self.fake.writes.append((f"{kind.kind}/{name}", f"patch {subresource or ''}".strip()))
        live = self.fake.objects[(kind.kind, name)]
        live.update(merge_patch(live, {k: v for k, v in patch.items() if k != "metadata"}))
        return copy.deepcopy(dict(live))

    def list(self, *, kind: kube.Kind, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        wanted = dict(pair.split("=", 1) for pair in label_selector.split(",") if pair)
        found: list[dict[str, Any]] = self.fake.list(kind=kind, namespace=namespace, label_selector=label_selector)
        return [p for p in found if wanted.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()]


def engine_counters(
    *, steps: float, prefill_tokens: float, pairs: float, rows: float, context: float, theta: StepCoefficients = PRIOR
) -> dict[str, float]:
    """A window of step counters whose busy seconds follow ``theta`` exactly."""
    seconds = (
        theta.step * steps
        + theta.prefill_token * prefill_tokens
        + theta.prefill_pair * pairs
        + theta.decode_row * rows
        + theta.decode_context * context
    )
    return dict(zip(ENGINE, (steps, seconds, prefill_tokens, pairs, rows, context), strict=True))


def pod(role: str, index: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{NAME}-{role}-{index}", "namespace": NS, "labels": naming.labels(NAME, role)},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def isvc(
    *, dry_run: bool = False, slo: bool = True, queue_target: float = 4.0, scale_down_window: int = 300
) -> dict[str, Any]:
    pool = {"replicas": {"min": 1, "max": 8}, "resources": {"gpus": 1}}
    autoscaling: dict[str, Any] = {
        "dryRun": dry_run,
        "prefill": {"targetQueueDepth": queue_target},
        "decode": {"targetQueueDepth": queue_target},
        "behavior": {"scaleUp": {"maxStepPercent": 1000}, "scaleDown": {"stabilizationSeconds": scale_down_window}},
    }
    if slo:
        autoscaling["slo"] = {
            "ttftP99": "500ms",
            "itlP99": "50ms",
            "prior": {
                "step": PRIOR.step,
                "prefillToken": PRIOR.prefill_token,
                "prefillPair": PRIOR.prefill_pair,
                "decodeRow": PRIOR.decode_row,
                "decodeContext": PRIOR.decode_context,
            },
        }
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-svc", "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "mode": "Disaggregated",
            "prefill": copy.deepcopy(pool),
            "decode": copy.deepcopy(pool),
            "autoscaling": autoscaling,
        },
    }


def cluster(obj: dict[str, Any], *, prefill: int = 1, decode: int = 1) -> SelectingKube:
    api = SelectingKube()
    api.objects[(contract.KIND, NAME)] = copy.deepcopy(obj)
    for role, replicas in (("prefill", prefill), ("decode", decode)):
        name = naming.child_name(NAME, role)
        api.objects[("Deployment", name)] = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": replicas},
        }
        api.fake.pods += [pod(role, i) for i in range(replicas)]
    return api


def busy_prometheus(*, waiting: float = 0.0, rate: float = 40.0) -> FakePrometheus:
    """One prefill and one decode pod under ``rate`` requests/s of 1000-token prompts and
    200-token outputs: far more than one pod of each meets 500 ms / 50 ms with."""
    prom = FakePrometheus()
    prefill, decode = f"{NAME}-prefill-0", f"{NAME}-decode-0"
    prom.roles = {prefill: "prefill", decode: "decode"}
    prom.pods[prefill] = {
        Metric.REQUESTS_WAITING: waiting,
        Metric.REQUESTS_RUNNING: 4.0,
        Metric.PROMPT_TOKENS_WAITING: waiting * 1000,
        Metric.KV_CACHE_USAGE_RATIO: 0.2,
        Metric.KV_CACHE_BLOCKS: 4096,
        **engine_counters(steps=600, prefill_tokens=900_000, pairs=4.5e8, rows=0, context=0),
    }
    prom.pods[decode] = {
        Metric.REQUESTS_WAITING: waiting,
        Metric.REQUESTS_RUNNING: 60.0,
        Metric.PROMPT_TOKENS_WAITING: 0.0,
        Metric.KV_CACHE_USAGE_RATIO: 0.9,
        Metric.KV_CACHE_BLOCKS: 4096,
        **engine_counters(steps=900, prefill_tokens=0, pairs=0, rows=54_000, context=6.5e7),
    }
    # prompts are counted where they are computed: 90 % on prefill, 10 % sent straight to decode
    prom.pool["prefill"] = {
        "ttft": 2.5,
        "rate:" + Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL: rate * 1000,
        "rate:" + Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL: rate * 100,
        "rate:" + Metric.PROMPT_TOKENS_TOTAL: rate * 900,
    }
    prom.pool["decode"] = {
        "ttft": 0.05,
        "itl": 0.12,
        "rate:" + Metric.REQUESTS_TOTAL: rate,
        "rate:" + Metric.PROMPT_TOKENS_TOTAL: rate * 100,
        "rate:" + Metric.GENERATION_TOKENS_TOTAL: rate * 200,
    }
    return prom


def round_(
    api: SelectingKube,
    prom: FakePrometheus,
    *,
    store: SloStore | None,
    state: AutoscalerState | None = None,
    now: float = NOW,
) -> dict[str, Any]:
    live = api.objects[(contract.KIND, NAME)]
    decisions = asyncio.run(
        run_once(
            isvc=copy.deepcopy(live),
            api=cast(kube.Kube, api),
            prometheus=prom,
            state=state if state is not None else AutoscalerState(),
            metrics=AutoscalerMetrics.create(registry=CollectorRegistry()),
            now_seconds=now,
            logger=logging.getLogger("test"),
            slo_store=store,
        )
    )
    return {d.pool: d for d in decisions}


@pytest.fixture(autouse=True)
def _events(monkeypatch: pytest.MonkeyPatch) -> None:
    record_events(monkeypatch)


def replicas(api: SelectingKube, role: str) -> int:
    return int(api.objects[("Deployment", naming.child_name(NAME, role))]["spec"]["replicas"])


def saved_state(api: SelectingKube) -> tuple[dict[str, Any], SloState]:
    cm = api.objects[("ConfigMap", slo_state_config_map_name(NAME))]
    return cm, SloState.from_json(cm["data"][store_module.STATE_KEY])


# --------------------------------------------------------------------------- rounds
def test_an_slo_round_scales_reports_the_model_and_persists_the_state() -> None:
    api, prom, store = cluster(isvc()), busy_prometheus(), SloStore()
    decisions = round_(api, prom, store=store)
    assert set(decisions) == {"prefill", "decode"}
    for role, decision in decisions.items():
        assert decision.model, role  # an SLO decision, with its model
        assert replicas(api, role) == decision.result
    assert decisions["decode"].result > 1  # 40 req/s of 200 tokens at 50 ms ITL needs more than one pod
    status = api.objects[(contract.KIND, NAME)]["status"]
    for role in ("prefill", "decode"):
        last = status[role]["lastDecision"]
        assert last["result"] == decisions[role].result and last["reason"] == decisions[role].reason
        assert last["model"] == dict(decisions[role].model or {})
        assert all(isinstance(v, float) for v in last["model"].values())
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["MetricsHealthy"]["status"] == "True"

    cm, state = saved_state(api)
    assert cm["metadata"]["labels"][contract.LABEL_MANAGED_BY] == contract.MANAGED_BY_VALUE
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (contract.KIND, NAME, "uid-svc", False)
    assert state.fits["prefill"].points >= 1 and state.fits["decode"].points >= 1
    assert state.to_json() == store.entries[(NS, NAME)].state.to_json()
    # the scale-up writes started pod-start measurements
    assert any(state.pending_writes.get(role) for role in ("prefill", "decode") if decisions[role].result > 1)


def test_a_restarted_operator_continues_from_the_configmap() -> None:
    api, prom = cluster(isvc()), busy_prometheus()
    round_(api, prom, store=SloStore())
    _, before = saved_state(api)
    fresh = SloStore()  # a new operator process: nothing in memory
    reads = len([w for w in api.writes if w[0].startswith("ConfigMap/")])
    loaded = fresh.load(api=api, namespace=NS, name=NAME)
    assert loaded.to_json() == before.to_json()
    assert loaded.fits["decode"].points == before.fits["decode"].points >= 1
    # and the next round builds on it: more points, saved again (forced: replicas were written or not)
    round_(api, prom, store=fresh, now=NOW + 120)
    _, after = saved_state(api)
    assert after.fits["decode"].points > before.fits["decode"].points
    assert len([w for w in api.writes if w[0].startswith("ConfigMap/")]) > reads


def test_later_rounds_cost_no_configmap_request_until_the_save_interval() -> None:
    api, prom, store = cluster(isvc(dry_run=True)), busy_prometheus(), SloStore()
    round_(api, prom, store=store)
    assert api.gets.count(("ConfigMap", slo_state_config_map_name(NAME))) == 1
    assert api.writes.count(("ConfigMap/" + slo_state_config_map_name(NAME), "apply")) == 1
    round_(api, prom, store=store, now=NOW + 15)  # the fit changed, but the last write is 15 s old
    assert api.gets.count(("ConfigMap", slo_state_config_map_name(NAME))) == 1
    assert api.writes.count(("ConfigMap/" + slo_state_config_map_name(NAME), "apply")) == 1
    decisions = round_(api, prom, store=store, now=NOW + 75)
    assert api.writes.count(("ConfigMap/" + slo_state_config_map_name(NAME), "apply")) == 2
    # the merged status holds exactly this round's model, whatever the earlier rounds wrote
    status = api.objects[(contract.KIND, NAME)]["status"]
    assert status["decode"]["lastDecision"]["model"] == dict(decisions["decode"].model or {})


def test_an_unreadable_configmap_gives_a_fresh_state_not_an_error() -> None:
    api, prom = cluster(isvc()), busy_prometheus()
    api.objects[("ConfigMap", slo_state_config_map_name(NAME))] = {
        "metadata": {"name": slo_state_config_map_name(NAME)},
        "data": {store_module.STATE_KEY: "{not json"},
    }
    decisions = round_(api, prom, store=SloStore())
    assert decisions["decode"].model
    _, state = saved_state(api)
    assert state.fits["decode"].points >= 1


def test_target_tracking_counts_are_floors() -> None:
    # queues of 30 per pod against a target of 1: target tracking alone asks for the max (8)
    prom = busy_prometheus(waiting=30.0, rate=0.5)
    floors_api = cluster(isvc(slo=False, dry_run=True, queue_target=1.0))
    floors = round_(floors_api, prom, store=None)
    assert floors["prefill"].result == 8 and floors["decode"].result == 8
    api = cluster(isvc(queue_target=1.0))
    decisions = round_(api, prom, store=SloStore())
    for role in ("prefill", "decode"):
        assert decisions[role].model
        assert decisions[role].result >= floors[role].result
        assert replicas(api, role) == decisions[role].result


def test_dry_run_computes_reports_and_learns_without_writing_replicas() -> None:
    api, prom = cluster(isvc(dry_run=True)), busy_prometheus()
    decisions = round_(api, prom, store=SloStore())
    assert decisions["decode"].result > 1 and decisions["decode"].dry_run
    assert replicas(api, "decode") == 1 and replicas(api, "prefill") == 1
    status = api.objects[(contract.KIND, NAME)]["status"]
    assert status["decode"]["lastDecision"]["model"]
    assert {c["type"]: c for c in status["conditions"]}["ScalingActive"]["reason"] == Reason.DRY_RUN
    _, state = saved_state(api)  # the fit still learns
    assert state.fits["decode"].points >= 1 and not any(state.pending_writes.values())


def test_a_missing_load_holds_and_reports_metrics_unhealthy() -> None:
    api, prom = cluster(isvc()), busy_prometheus()
    prom.failing.add(Metric.REQUESTS_TOTAL)
    decisions = round_(api, prom, store=SloStore())
    assert replicas(api, "decode") == 1 and replicas(api, "prefill") == 1
    assert all(d.result == 1 and d.hold for d in decisions.values())
    _, state = saved_state(api)  # the fits learnt from the step counters all the same
    assert state.fits["decode"].points >= 1
    status = api.objects[(contract.KIND, NAME)]["status"]
    healthy = {c["type"]: c for c in status["conditions"]}["MetricsHealthy"]
    assert healthy["status"] == "False" and Metric.REQUESTS_TOTAL in healthy["message"]


def test_pool_metrics_unavailable_hold_as_without_an_slo() -> None:
    api, prom = cluster(isvc()), busy_prometheus()
    prom.roles.pop(f"{NAME}-decode-0")  # no series for the decode pod at all
    decisions = round_(api, prom, store=SloStore())
    assert decisions["decode"].hold and decisions["decode"].model is None
    assert replicas(api, "decode") == 1


def test_no_pool_scales_down_while_another_pools_metrics_are_missing() -> None:
    prom = busy_prometheus(rate=0.1)
    for pod_name in ("svc-prefill-1", "svc-prefill-2"):
        prom.roles[pod_name] = "prefill"
        prom.pods[pod_name] = dict(prom.pods["svc-prefill-0"])
    prom.roles.pop(f"{NAME}-decode-0")
    # without an SLO, target tracking shrinks the idle prefill pool (no stabilization window)
    plain = cluster(isvc(slo=False, dry_run=True, scale_down_window=0), prefill=3)
    assert round_(plain, prom, store=None)["prefill"].result == 2
    api = cluster(isvc(scale_down_window=0), prefill=3)
    decisions = round_(api, prom, store=SloStore())
    assert decisions["prefill"].hold and decisions["prefill"].result == 3 and replicas(api, "prefill") == 3
    assert decisions["decode"].hold


def test_an_aggregated_service_reads_everything_from_its_one_pool() -> None:
    obj = isvc()
    spec = obj["spec"]
    spec["mode"] = "Aggregated"
    spec["aggregated"] = spec.pop("prefill")
    del spec["decode"]
    api = SelectingKube()
    api.objects[(contract.KIND, NAME)] = obj
    deployment = naming.child_name(NAME, "aggregated")
    api.objects[("Deployment", deployment)] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment, "namespace": NS},
        "spec": {"replicas": 1},
    }
    api.fake.pods += [pod("aggregated", 0)]
    prom = busy_prometheus()
    both = {**prom.pods.pop(f"{NAME}-prefill-0"), **prom.pods.pop(f"{NAME}-decode-0")}
    prom.roles = {f"{NAME}-aggregated-0": "aggregated"}
    prom.pods[f"{NAME}-aggregated-0"] = both
    prom.pool["aggregated"] = {**prom.pool.pop("prefill"), **prom.pool.pop("decode")}
    decisions = round_(api, prom, store=SloStore())
    assert set(decisions) == {"aggregated"} and decisions["aggregated"].model
    assert decisions["aggregated"].model["requestRate"] == pytest.approx(40.0)
    assert replicas(api, "aggregated") == decisions["aggregated"].result > 1
    assert all('role="aggregated"' in q for q in prom.queries)
    _, state = saved_state(api)
    assert set(state.fits) == {"aggregated"}


def test_a_round_without_slo_writes_no_configmap_and_no_model() -> None:
    api, prom = cluster(isvc(slo=False)), busy_prometheus()
    decisions = round_(api, prom, store=SloStore())
    assert all(d.model is None for d in decisions.values())
    assert ("ConfigMap", slo_state_config_map_name(NAME)) not in api.objects
    assert "model" not in api.objects[(contract.KIND, NAME)]["status"]["decode"]["lastDecision"]


# --------------------------------------------------------------------------- store
def test_the_store_writes_only_changes_and_at_most_every_interval() -> None:
    api = SelectingKube()
    api.objects[(contract.KIND, NAME)] = isvc()
    store = SloStore(min_save_interval_seconds=60)
    state = store.load(api=api, namespace=NS, name=NAME)
    assert store.save(api=api, namespace=NS, name=NAME, uid="u", now_seconds=0.0)  # first: nothing saved yet
    assert not store.save(api=api, namespace=NS, name=NAME, uid="u", now_seconds=1.0)  # unchanged
    state.record_replicas_write("decode", 1.0, 3)
    assert not store.save(api=api, namespace=NS, name=NAME, uid="u", now_seconds=30.0)  # too soon
    assert store.save(api=api, namespace=NS, name=NAME, uid="u", now_seconds=30.0, force=True)
    state.record_replicas_write("decode", 31.0, 4)
    assert store.save(api=api, namespace=NS, name=NAME, uid="u", now_seconds=91.0)
    store.forget(namespace=NS, name=NAME)
    assert SloStore().load(api=api, namespace=NS, name=NAME).pending_writes["decode"] == [(1.0, 3), (31.0, 4)]


# --------------------------------------------------------------------------- signals
def test_step_samples_are_per_live_pod_and_skip_idle_or_partial_pods() -> None:
    prom = FakePrometheus()
    prom.roles = {"a": "decode", "b": "decode", "idle": "decode", "old": "decode", "gone": "decode"}
    prom.pods = {
        "a": engine_counters(steps=10, prefill_tokens=0, pairs=0, rows=100, context=1000),
        "b": engine_counters(steps=20, prefill_tokens=5, pairs=15, rows=200, context=3000),
        "idle": engine_counters(steps=0, prefill_tokens=0, pairs=0, rows=0, context=0),
        "old": {Metric.ENGINE_STEPS_TOTAL: 5.0},  # a runtime without the other counters
        "gone": engine_counters(steps=99, prefill_tokens=0, pairs=0, rows=1, context=1),
    }
    samples = fetch_step_samples(
        prometheus=prom,
        now_seconds=NOW,
        window_seconds=30,
        selector='{namespace="ns",inferenceservice="svc",role="decode",pod=~"a|b|idle|old"}',
    )
    assert [(s.steps, s.decode_rows, s.prefill_attention_pairs) for s in samples] == [(10, 100, 0), (20, 200, 15)]
    assert samples[1].seconds == pytest.approx(
        PRIOR.step * 20
        + PRIOR.prefill_token * 5
        + PRIOR.prefill_pair * 15
        + PRIOR.decode_row * 200
        + PRIOR.decode_context * 3000
    )
    # the six totals, then the decode-only part (which these pods do not export: whole windows)
    assert all(
        f"increase({m}" in q and "[30s]" in q for m, q in zip(ENGINE + DECODE_ONLY_COUNTERS, prom.queries, strict=True)
    )


def test_a_pod_exporting_the_decode_only_counters_gives_two_points() -> None:
    """An aggregated pod's window: 20 steps, 15 of them decode-only. The operator queries the
    decode-only part beside the totals and hands the fit that part and the rest."""
    prom = FakePrometheus()
    prom.roles = {"a": "aggregated"}
    total = engine_counters(steps=20, prefill_tokens=300, pairs=45_150, rows=200, context=30_000)
    decode_only = engine_counters(steps=15, prefill_tokens=0, pairs=0, rows=150, context=22_000)
    prom.pods = {
        "a": {
            **total,
            Metric.ENGINE_DECODE_ONLY_STEPS_TOTAL: 15,
            Metric.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL: decode_only[Metric.ENGINE_STEP_SECONDS_TOTAL],
            Metric.ENGINE_DECODE_ONLY_ROWS_TOTAL: 150,
            Metric.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL: 22_000,
        }
    }
    first, rest = fetch_step_samples(
        prometheus=prom,
        now_seconds=NOW,
        window_seconds=30,
        selector='{namespace="ns",inferenceservice="svc",role="aggregated",pod=~"a"}',
    )
    assert (first.steps, first.prefill_tokens, first.decode_rows, first.decode_context_tokens) == (15, 0, 150, 22_000)
    assert (
        rest.steps,
        rest.prefill_tokens,
        rest.prefill_attention_pairs,
        rest.decode_rows,
        rest.decode_context_tokens,
    ) == (5, 300, 45_150, 50, 8_000)
    assert first.seconds == pytest.approx(decode_only[Metric.ENGINE_STEP_SECONDS_TOTAL])
    assert first.seconds + rest.seconds == pytest.approx(total[Metric.ENGINE_STEP_SECONDS_TOTAL])


def test_a_prefill_pool_is_read_without_the_decode_only_queries() -> None:
    """A Disaggregated prefill pod finishes each request at its first token: it never runs a
    decode-only step, so its pool's windows are taken whole and the four decode-only counters
    are not queried (``split=False``, what :func:`fetch_pool_slo` passes for a prefill pool)."""
    prom = FakePrometheus()
    prom.roles = {"p": "prefill"}
    prom.pods = {"p": engine_counters(steps=12, prefill_tokens=4096, pairs=2_000_000, rows=0, context=0)}
    selector = '{namespace="ns",inferenceservice="svc",role="prefill",pod=~"p"}'
    (whole,) = fetch_step_samples(prometheus=prom, now_seconds=NOW, window_seconds=30, selector=selector, split=False)
    assert (whole.steps, whole.prefill_tokens, whole.decode_rows) == (12, 4096, 0)
    assert len(prom.queries) == len(ENGINE)
    assert not any(m in q for m in DECODE_ONLY_COUNTERS for q in prom.queries)
    sample = PoolSample(
        requests_waiting_by_pod={"p": 0.0},
        requests_running_by_pod={"p": 1.0},
        prompt_tokens_waiting_by_pod={"p": 0.0},
        kv_cache_usage_ratio_by_pod={"p": 0.1},
        newest_sample_age_seconds=1.0,
    )
    prom.queries.clear()
    obs = fetch_pool_slo(
        prometheus=prom,
        namespace=NS,
        inferenceservice=NAME,
        role="prefill",
        pods=["p"],
        sample=sample,
        current_replicas=1,
        pending_replicas=0,
        block_size=16,
        attainment=0.99,
        now_seconds=NOW,
    )
    assert [s.steps for s in obs.step_samples] == [12]
    assert not any(m in q for m in DECODE_ONLY_COUNTERS for q in prom.queries)


def test_pool_slo_observation_sums_live_pods_and_reads_capacity_and_quantiles() -> None:
    prom = busy_prometheus(waiting=3.0)
    prom.roles["svc-decode-1"] = "decode"
    prom.pods["svc-decode-1"] = {**prom.pods["svc-decode-0"], Metric.KV_CACHE_BLOCKS: 2048}
    sample = PoolSample(
        requests_waiting_by_pod={"svc-decode-0": 3.0, "svc-decode-1": 1.0},
        requests_running_by_pod={"svc-decode-0": 60.0, "svc-decode-1": 20.0},
        prompt_tokens_waiting_by_pod={},
        kv_cache_usage_ratio_by_pod={"svc-decode-0": 0.9, "svc-decode-1": 0.5},
        newest_sample_age_seconds=1.0,
    )
    obs = fetch_pool_slo(
        prometheus=prom,
        namespace=NS,
        inferenceservice=NAME,
        role="decode",
        pods=["svc-decode-0", "svc-decode-1"],
        sample=sample,
        current_replicas=3,
        pending_replicas=1,
        block_size=16,
        attainment=0.95,
        now_seconds=NOW,
    )
    assert (obs.current_replicas, obs.ready_replicas, obs.pending_replicas) == (3, 2, 1)
    assert (obs.requests_waiting, obs.requests_running) == (4.0, 80.0)
    assert obs.kv_cache_usage_ratio == pytest.approx(0.7)
    assert obs.kv_cache_tokens_per_replica == 2048 * 16  # the smaller pod's
    assert (obs.ttft_p99_seconds, obs.itl_p99_seconds) == (0.05, 0.12)
    assert len(obs.step_samples) == 2
    quantiles = [q for q in prom.queries if q.startswith("histogram_quantile")]
    assert len(quantiles) == 2 and all(q.startswith("histogram_quantile(0.95, sum by (le)") for q in quantiles)
    assert all('pod=~"svc\\\\-decode\\\\-0|svc\\\\-decode\\\\-1"' in q or "pod=~" in q for q in prom.queries)


def test_load_comes_from_the_entry_pool_prompts_from_where_computed_and_the_prefix_ratio_from_prefill() -> None:
    prom = busy_prometheus(rate=8.0)
    load = fetch_load(
        prometheus=prom,
        namespace=NS,
        inferenceservice=NAME,
        entry_role="decode",
        entry_pods=["svc-decode-0"],
        prefill_role="prefill",
        prefill_pods=["svc-prefill-0"],
        now_seconds=NOW,
        window_seconds=30,
    )
    assert (load.request_rate, load.prompt_tokens_mean, load.output_tokens_mean) == (8.0, 1000.0, 200.0)
    assert load.prefix_hit_ratio == pytest.approx(0.1) and load.window_seconds == 30
    assert (load.recent_prompt_tokens_mean, load.recent_output_tokens_mean) == (None, None)  # not asked
    recent = fetch_load(
        prometheus=prom,
        namespace=NS,
        inferenceservice=NAME,
        entry_role="decode",
        entry_pods=["svc-decode-0"],
        prefill_role="prefill",
        prefill_pods=["svc-prefill-0"],
        now_seconds=NOW,
        window_seconds=30,
        recent_seconds=5,
    )
    assert (recent.recent_prompt_tokens_mean, recent.recent_output_tokens_mean) == (1000.0, 200.0)
    assert len([q for q in prom.queries if q.endswith("[5s]))")]) == 4  # requests, 2 prompt counters, outputs
    idle = FakePrometheus()
    idle.roles = {"d": "decode"}
    idle.pool["decode"] = {"rate:" + Metric.REQUESTS_TOTAL: 0.0}
    quiet = fetch_load(
        prometheus=idle,
        namespace=NS,
        inferenceservice=NAME,
        entry_role="decode",
        entry_pods=["d"],
        prefill_role="prefill",
        prefill_pods=[],
        now_seconds=NOW,
    )
    assert (quiet.request_rate, quiet.prompt_tokens_mean, quiet.prefix_hit_ratio) == (0.0, 0.0, 0.0)
    with pytest.raises(MetricsUnavailable) as info:
        fetch_load(
            prometheus=idle,
            namespace=NS,
            inferenceservice=NAME,
            entry_role="decode",
            entry_pods=[],
            prefill_role="prefill",
            prefill_pods=[],
            now_seconds=NOW,
        )
    assert info.value.reason == Reason.NO_DATA
