"""Chaos under load on the local cluster (issue 12): nothing lost when parts die.

A Disaggregated InferenceService with the tiny model (two prefill, two decode and two router
pods, containers on the kubelet node) serves a bounded load from client threads that talk
to the router Service's endpoints as a client behind a Service would. While the load runs, the
test in turn

* SIGKILLs a prefill pod's container (its PID 1; the kubelet restarts the container),
* stalls a prefill pod (SIGSTOP of every process in its container: it accepts connections and
  answers nothing) for longer than the router's prefill budget, then lets it go on (SIGCONT),
* SIGKILLs a decode pod's container,
* wedges a decode pod the same way for ``WEDGE_SECONDS``, then lets it go on,
* deletes a router pod (a rollout or node drain: graceful),
* force-deletes the operator's leader pod,
* restarts the kube-apiserver, then edits the spec and sees the edit applied,
* restarts Prometheus, then sees the autoscaler's metrics healthy again,

and prints a table of requests sent / ok / failed per phase with each failure's reason. The
bar: no failed request except streams that had started on the killed or wedged decode pod
(their work is lost with the process: the router cannot move a stream whose tokens the client
already has); the client retries only a connect that never reached a router (what any HTTP
client does with a refused connection).

The stalled prefill pod costs the requests already sent to it the router's prefill budget
(``--prefill-timeout-seconds``, contract ``defaults.PREFILL_TIMEOUT_SECONDS``; no
InferenceService field sets it, so the stall outlasts the default), after which a decode pod
computes their prompts (route "fallback", read from the routers' ``/metrics``); the routers'
health polls take the pod out of rotation within a poll, so a request sent later is neither
failed nor slowed by the budget. Both stops stay shorter than the kubelet's liveness window
(``LIVENESS_WINDOW_SECONDS``): this pins the router's handling of a silent pod, not the
kubelet's restart of it (the kill phases cover a restart). When a request failed unexpectedly
or with a 500, the routers' log tails are printed with the table (taken at the end of the phase,
before a later phase deletes a router pod and its log).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import splitserve_contract as contract
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import (
    apply_object,
    condition,
    get_isvc,
    pod_summary,
    router_endpoints,
    wait_ready,
)
from splitserve_e2e.procsignal import stopped
from splitserve_e2e.stack import RELEASE, SERVED_NAME, ModelHub, isvc_manifest, operator_namespace

pytestmark = pytest.mark.e2e

NAME = "chaos"
REPLICAS = 2
CONCURRENCY = 4
MAX_TOKENS = 12
STEADY_SECONDS = 5.0
RECOVER_SECONDS = 180.0
CONNECT_RETRY_SECONDS = 60.0
KILL_DECODE = "kill decode"
STALL_PREFILL = "stall prefill"
WEDGE_DECODE = "wedge decode"
DECODE_FAULTS = frozenset({KILL_DECODE, WEDGE_DECODE})
PREFILL_BUDGET_SECONDS = contract.defaults.PREFILL_TIMEOUT_SECONDS
LIVENESS_WINDOW_SECONDS = 50.0
"""A stopped pod's /health fails the kubelet's liveness probe (every 10 s, 6 failures) no
sooner than this after the stop: the stops end before it."""
DETECT_SECONDS = 8.0
"""How soon after a stop a router's health poll (every 2 s, 2 s timeout, out after one
failure) or the pod's readiness has taken the pod out: requests started later must not wait
on it."""
SLACK_SECONDS = 5.0
"""The longest a request on the healthy pods may take while one pod is stopped."""
STALL_HOLD_SECONDS = 6.0
"""How long the prefill pod stays stopped after the first fallback was counted."""
WEDGE_SECONDS = 20.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    phase: str
    ok: bool
    stream: bool
    reason: str = ""
    connect_retries: int = 0
    started_at: float = 0.0  # time.monotonic() of the first send and of the end
    ended_at: float = 0.0
    streaming: bool = False  # a stream the router had answered 200 (tokens may have followed)


@dataclasses.dataclass
class Phase:
    name: str
    seconds: float = 0.0
    detail: str = ""


class ChaosLoad:
    """``CONCURRENCY`` client threads, each sending its next completion (alternately streamed
    and not) when the last one ends, to the router endpoints in turn. A request that failed
    to connect, or whose connection closed before any response byte, is sent again to the
    next endpoint (it never reached a router); everything else is recorded as it ended."""

    def __init__(self, endpoints: Callable[[], list[str]], *, max_requests: int = 20_000) -> None:
        self._endpoints_source = endpoints
        self._endpoints: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sent = 0
        self._max_requests = max_requests
        self.phase = "steady"
        self.outcomes: list[Outcome] = []

    def ok_count(self) -> int:
        with self._lock:
            return sum(o.ok for o in self.outcomes)

    def start(self) -> None:
        self._refresh()
        self._threads = [
            threading.Thread(target=self._worker, name=f"chaos-load-{i}", daemon=True) for i in range(CONCURRENCY)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _refresh(self) -> list[str]:
        try:
            found = self._endpoints_source()
        except Exception:  # noqa: BLE001 - the API server may be restarting: keep the last list
            found = []
        with self._lock:
            if found:
                self._endpoints = found
            return list(self._endpoints)

    def _next_index(self) -> int | None:
        with self._lock:
            if self._sent >= self._max_requests:
                return None
            self._sent += 1
            return self._sent

    def _worker(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(90.0, connect=5.0)) as client:
            while not self._stop.is_set():
                index = self._next_index()
                if index is None:
                    return
                outcome = self._one(client, index)
                with self._lock:
                    self.outcomes.append(outcome)

    def _one(self, client: httpx.Client, index: int) -> Outcome:
        stream = index % 2 == 0
        # ignore_eos: the tiny model's greedy answer to some prompts is its end-of-text token
        # at once, an empty completion the stream check would count as broken
        body = {
            "model": SERVED_NAME,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "stream": stream,
            "ignore_eos": True,
            "prompt": f"request {index} {uuid.uuid4().hex}: the router pairs prefill and decode pods "
            "and the decode pod pulls the prompt's KV blocks before it answers.",
        }
        retries = 0
        started = time.monotonic()
        deadline = started + CONNECT_RETRY_SECONDS
        streaming = False
        while True:
            endpoints = self._refresh() if retries else list(self._endpoints)
            endpoint = endpoints[(index + retries) % len(endpoints)] if endpoints else ""
            responded = False
            try:
                if not endpoint:
                    raise httpx.ConnectError("no router endpoint")
                url = f"http://{endpoint}/v1/completions"
                if stream:
                    with client.stream("POST", url, json=body) as response:
                        responded = True
                        if response.status_code != 200:
                            response.read()
                            return self._failed(
                                stream, retries, f"HTTP {response.status_code}: {response.text[:160]}", started=started
                            )
                        streaming = True
                        reason = _stream_problem(response.iter_lines())
                else:
                    response = client.post(url, json=body)
                    responded = True
                    reason = (
                        ""
                        if response.status_code == 200 and response.json().get("choices")
                        else (f"HTTP {response.status_code}: {response.text[:160]}")
                    )
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as error:
                if not responded and time.monotonic() < deadline:
                    retries += 1
                    time.sleep(0.2)
                    continue
                reason = f"{type(error).__name__}: {error}"[:200]
            except httpx.HTTPError as error:
                reason = f"{type(error).__name__}: {error}"[:200]
            if reason:
                return self._failed(stream, retries, reason, started=started, streaming=streaming)
            return Outcome(
                phase=self.phase,
                ok=True,
                stream=stream,
                connect_retries=retries,
                started_at=started,
                ended_at=time.monotonic(),
                streaming=streaming,
            )

    def _failed(self, stream: bool, retries: int, reason: str, *, started: float, streaming: bool = False) -> Outcome:
        return Outcome(
            phase=self.phase,
            ok=False,
            stream=stream,
            reason=reason,
            connect_retries=retries,
            started_at=started,
            ended_at=time.monotonic(),
            streaming=streaming,
        )


def _stream_problem(lines: Iterator[str]) -> str:
    """ "" when the SSE stream carried at least one token and ended with [DONE]; else why not."""
    tokens = 0
    seen: list[str] = []  # the last events, for the failure's reason
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        seen = [*seen[-2:], data[:300]]
        if data == "[DONE]":
            return "" if tokens else f"stream ended without a token; last events: {' | '.join(seen)}"
        event = json.loads(data)
        if "error" in event:
            return f"error event: {json.dumps(event['error'])[:160]}"
        tokens += sum(1 for c in event.get("choices") or [] if c.get("text"))
    return f"stream cut after {tokens} tokens"


# --------------------------------------------------------------------------- cluster helpers
def _pods(cluster: LocalCluster, namespace: str, role: str) -> list[Any]:
    selector = f"{contract.LABEL_INSTANCE}={NAME},{contract.LABEL_ROLE}={role}"
    core: Any = cluster.core()
    return [
        p
        for p in core.list_namespaced_pod(namespace, label_selector=selector).items
        if not p.metadata.deletion_timestamp
    ]


def _restarts(pod: Any) -> int:
    return sum(int(s.restart_count or 0) for s in (pod.status.container_statuses or []))


def _ready(pod: Any) -> bool:
    statuses = pod.status.container_statuses or []
    return bool(statuses) and all(s.ready for s in statuses)


def _kill_container(cluster: LocalCluster, namespace: str, role: str) -> str:
    """SIGKILL one pod's container (its PID 1, tini: the kernel ends every process in the
    container with it, as a crash would); wait until the kubelet restarted it and it is
    Ready again."""
    pod = _pods(cluster, namespace, role)[0]
    name, restarts = pod.metadata.name, _restarts(pod)
    pid = cluster.container_pid(namespace=namespace, pod=name)
    assert pid is not None, f"{name} has no running container"
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        current = cluster.core().read_namespaced_pod(name, namespace)
        return _restarts(current) > restarts and _ready(current)

    cluster.wait_for(back, timeout_seconds=RECOVER_SECONDS, what=f"{name} restarted and Ready")
    return str(name)


@dataclasses.dataclass(frozen=True)
class Stop:
    """One pod's processes stopped from ``stopped_at`` to ``continued_at`` (time.monotonic())."""

    pod: str
    stopped_at: float
    continued_at: float


def _stop_container(
    cluster: LocalCluster, namespace: str, role: str, hold: Callable[[float], None]
) -> tuple[Stop, int]:
    """SIGSTOP every process of one pod's container (it accepts connections and answers
    nothing), call ``hold(stopped_at)``, SIGCONT them (also when ``hold`` raised), and wait until
    the pool is Ready again. The stop and the pod's container restarts during it (0 when the
    kubelet's liveness probe did not fire)."""
    pod = _pods(cluster, namespace, role)[0]
    name, restarts = str(pod.metadata.name), _restarts(pod)
    pid = cluster.container_pid(namespace=namespace, pod=name)
    assert pid is not None, f"{name} has no running container"
    with stopped(pid) as pids:
        assert len(pids) > 1, f"{name}: only tini ({pids}) found to stop; the server is its child"
        stopped_at = time.monotonic()
        hold(stopped_at)
    continued_at = time.monotonic()
    _wait_pool_ready(cluster, namespace, role, REPLICAS)
    current = cluster.core().read_namespaced_pod(name, namespace)
    return Stop(pod=name, stopped_at=stopped_at, continued_at=continued_at), _restarts(current) - restarts


def _held_by(stop: Stop, outcomes: list[Outcome], *, budget: float | None = None) -> tuple[int, list[Outcome]]:
    """The requests that started once the routers should have taken the stopped pod out
    (``DETECT_SECONDS`` after the stop, and early enough to end before it went on), and those of
    them that still waited for it: they ended only after it went on, or (``budget``) took at
    least that long."""
    window = [
        o
        for o in list(outcomes)
        if stop.stopped_at + DETECT_SECONDS <= o.started_at <= stop.continued_at - SLACK_SECONDS
    ]
    return len(window), [
        o
        for o in window
        if o.ended_at >= stop.continued_at or (budget is not None and o.ended_at - o.started_at >= budget)
    ]


def _router_metric(cluster: LocalCluster, namespace: str, name: str, **labels: str) -> float:
    """The sum of a router counter over the router pods now serving (each counts its own)."""
    total = 0.0
    for endpoint in router_endpoints(cluster=cluster, namespace=namespace, name=NAME):
        text = httpx.get(f"http://{endpoint}/metrics", timeout=5.0).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
    return total


def _fallbacks(cluster: LocalCluster, namespace: str) -> float:
    return _router_metric(cluster, namespace, "splitserve_router_routes_total", route="fallback")


def _router_logs(cluster: LocalCluster, namespace: str, *, lines: int = 80) -> str:
    """The last ``lines`` of every router pod's log (the traceback of a 500 is there)."""
    out = []
    try:
        names = [str(pod.metadata.name) for pod in _pods(cluster, namespace, "router")]
    except Exception as error:  # noqa: BLE001 - logs we cannot read must not hide the table
        return f"(router pods unavailable: {error!r})"
    for name in names:
        try:
            log = cluster.pod_log(namespace=namespace, pod=name)
        except Exception as error:  # noqa: BLE001
            log = f"(log unavailable: {error!r})"
        out.append(
            f"----- kubectl logs {name} -n {namespace} (last {lines} lines)\n" + "\n".join(log.splitlines()[-lines:])
        )
    return "\n".join(out)


def _expected_loss(outcome: Outcome) -> bool:
    """A failure the bar allows: a stream the router had started answering (its tokens came
    from the decode pod that was killed or wedged, and cannot move), in a decode fault phase."""
    return not outcome.ok and outcome.phase in DECODE_FAULTS and outcome.stream and outcome.streaming


def _suspicious(outcome: Outcome) -> bool:
    """A failure outside the bar (an HTTP 500 always is one)."""
    return not outcome.ok and not _expected_loss(outcome)


def _wait_pool_ready(cluster: LocalCluster, namespace: str, role: str, replicas: int) -> None:
    def ready() -> bool:
        pods = _pods(cluster, namespace, role)
        return len(pods) == replicas and all(_ready(p) for p in pods)

    try:
        cluster.wait_for(ready, timeout_seconds=RECOVER_SECONDS, what=f"{role} pool {replicas} Ready")
    except TimeoutError as error:
        raise TimeoutError(f"{error}; pods: {pod_summary(cluster=cluster, namespace=namespace)}") from None


def _lease_holder(cluster: LocalCluster, namespace: str) -> str:
    result = cluster.kubectl(
        "get",
        "lease",
        f"{RELEASE}-splitserve" if "splitserve" not in RELEASE else RELEASE,
        "-n",
        namespace,
        "-o",
        "jsonpath={.spec.holderIdentity}",
        check=False,
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def _operator_pods(cluster: LocalCluster, namespace: str) -> list[str]:
    selector = "app.kubernetes.io/component=operator"
    core: Any = cluster.core()
    return [
        str(p.metadata.name)
        for p in core.list_namespaced_pod(namespace, label_selector=selector).items
        if not p.metadata.deletion_timestamp and p.status.phase == "Running"
    ]


def _kill_operator_leader(cluster: LocalCluster, namespace: str) -> str:
    holder = _lease_holder(cluster, namespace)
    leader = next(p for p in _operator_pods(cluster, namespace) if holder.startswith(f"{p}_"))
    cluster.kubectl("delete", "pod", leader, "-n", namespace, "--grace-period=0", "--force", "--wait=false")

    def new_leader() -> str:
        held = _lease_holder(cluster, namespace)
        return next((p for p in _operator_pods(cluster, namespace) if p != leader and held.startswith(f"{p}_")), "")

    return str(cluster.wait_for(new_leader, timeout_seconds=RECOVER_SECONDS, what="a new operator leader"))


def _router_replicas(cluster: LocalCluster, namespace: str) -> int:
    deployment = cluster.apps().read_namespaced_deployment(f"{NAME}-router", namespace)
    return int(deployment.spec.replicas or 0)


def _metrics_healthy(cluster: LocalCluster, namespace: str) -> bool:
    healthy = (
        condition(get_isvc(cluster=cluster, namespace=namespace, name=NAME), contract.ConditionType.METRICS_HEALTHY)
        or {}
    )
    return healthy.get("status") == "True"


# --------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def served(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    """The namespace of a Ready Disaggregated InferenceService with every pool at two pods."""
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="chaos") as namespace:
        manifest = isvc_manifest(
            name=NAME, namespace=namespace, mode="Disaggregated", hub=model_hub, max_replicas=REPLICAS
        )
        for role in ("prefill", "decode"):
            manifest["spec"][role]["replicas"] = {"min": REPLICAS, "max": REPLICAS}
        manifest["spec"]["router"]["replicas"] = REPLICAS
        apply_object(cluster=cluster, obj=manifest)
        wait_ready(cluster=cluster, namespace=namespace, name=NAME, timeout_seconds=300)
        for role in ("prefill", "decode", "router"):
            _wait_pool_ready(cluster, namespace, role, REPLICAS)
        yield namespace


def test_chaos_under_load_loses_only_streams_on_a_killed_decode_pod(
    cluster: LocalCluster, served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = served
    load = ChaosLoad(lambda: router_endpoints(cluster=cluster, namespace=namespace, name=NAME))
    phases: list[Phase] = []
    problems: list[str] = []  # what a phase saw wrong, asserted after the table is printed
    router_logs: list[str] = []  # the routers' log tails after a phase with a suspicious failure
    suspicious_seen = 0

    def run_phase(name: str, action: Callable[[], str]) -> None:
        nonlocal suspicious_seen
        load.phase = name
        started = time.monotonic()
        detail = action()
        phases.append(Phase(name=name, seconds=time.monotonic() - started, detail=detail))
        time.sleep(STEADY_SECONDS)  # serve a while on the recovered system within the phase
        suspicious = sum(_suspicious(o) for o in list(load.outcomes))
        if suspicious > suspicious_seen:  # now, before a later phase deletes a router pod
            suspicious_seen = suspicious
            router_logs.append(f"===== router logs after phase {name!r}\n{_router_logs(cluster, namespace)}")

    def stall_prefill() -> str:
        before = _fallbacks(cluster, namespace)

        def hold(stopped_at: float) -> None:
            # until a request sent to the stalled pod spent its prefill budget and fell back
            try:
                cluster.wait_for(
                    lambda: _fallbacks(cluster, namespace) > before,
                    interval_seconds=0.5,
                    timeout_seconds=PREFILL_BUDGET_SECONDS + 6,
                    what="a fallback route",
                )
            except TimeoutError as error:
                problems.append(f"{STALL_PREFILL}: {error}")
            time.sleep(max(0.0, min(STALL_HOLD_SECONDS, stopped_at + LIVENESS_WINDOW_SECONDS - 5 - time.monotonic())))

        stop, restarts = _stop_container(cluster, namespace, "prefill", hold)
        fallbacks = _fallbacks(cluster, namespace) - before
        window, held = _held_by(stop, load.outcomes, budget=PREFILL_BUDGET_SECONDS)
        if held:
            problems.append(
                f"{STALL_PREFILL}: {len(held)} of {window} request(s) started {DETECT_SECONDS:g} s "
                f"after the stop still waited on {stop.pod}: {held[:3]}"
            )
        return (
            f"{stop.pod} stopped {stop.continued_at - stop.stopped_at:.1f}s; {fallbacks:g} fallback "
            f"route(s); {window - len(held)}/{window} later requests not held; restarts {restarts}"
        )

    def wedge_decode() -> str:
        served: list[int] = []

        def hold(stopped_at: float) -> None:
            time.sleep(DETECT_SECONDS)
            before = load.ok_count()
            time.sleep(max(0.0, stopped_at + WEDGE_SECONDS - time.monotonic()))
            served.append(load.ok_count() - before)

        stop, restarts = _stop_container(cluster, namespace, "decode", hold)
        window, held = _held_by(stop, load.outcomes)
        if held:
            problems.append(
                f"{WEDGE_DECODE}: {len(held)} of {window} request(s) started {DETECT_SECONDS:g} s "
                f"after the stop still waited on {stop.pod}: {held[:3]}"
            )
        if not served or not served[0]:
            problems.append(f"{WEDGE_DECODE}: nothing served by the other decode pod while {stop.pod} was stopped")
        return (
            f"{stop.pod} stopped {stop.continued_at - stop.stopped_at:.1f}s; {served[0] if served else 0} "
            f"served meanwhile; {window - len(held)}/{window} later requests not held; restarts {restarts}"
        )

    def delete_router() -> str:
        pod = str(_pods(cluster, namespace, "router")[0].metadata.name)
        cluster.kubectl("delete", "pod", pod, "-n", namespace, "--wait=false")
        cluster.wait_for(
            lambda: pod not in [p.metadata.name for p in _pods(cluster, namespace, "router")],
            timeout_seconds=RECOVER_SECONDS,
            what=f"{pod} gone",
        )
        _wait_pool_ready(cluster, namespace, "router", REPLICAS)
        return pod

    def restart_apiserver_then_edit() -> str:
        away = cluster.restart_component("kube-apiserver")
        cluster.kubectl(
            "patch",
            contract.PLURAL,
            NAME,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"router": {"replicas": REPLICAS + 1}}}),
        )
        cluster.wait_for(
            lambda: _router_replicas(cluster, namespace) == REPLICAS + 1,
            timeout_seconds=RECOVER_SECONDS,
            what="the spec edit applied after the restart",
        )
        _wait_pool_ready(cluster, namespace, "router", REPLICAS + 1)
        return f"API server back after {away:.1f}s; router replicas {REPLICAS} -> {REPLICAS + 1} applied"

    def restart_prometheus() -> str:
        away = cluster.restart_component("prometheus")
        cluster.wait_for(
            lambda: _metrics_healthy(cluster, namespace),
            timeout_seconds=RECOVER_SECONDS,
            what="MetricsHealthy=True after the Prometheus restart",
        )
        return f"Prometheus back after {away:.1f}s; MetricsHealthy=True"

    load.start()
    try:
        run_phase("steady", lambda: "")
        run_phase("kill prefill", lambda: _kill_container(cluster, namespace, "prefill"))
        run_phase(STALL_PREFILL, stall_prefill)
        run_phase(KILL_DECODE, lambda: _kill_container(cluster, namespace, "decode"))
        run_phase(WEDGE_DECODE, wedge_decode)
        run_phase("delete router pod", delete_router)
        run_phase("kill operator leader", lambda: "new leader " + _kill_operator_leader(cluster, namespace))
        run_phase("restart kube-apiserver", restart_apiserver_then_edit)
        run_phase("restart prometheus", restart_prometheus)
    finally:
        # the table and the logs also when a phase raised (a pool that did not come back)
        load.stop()
        table = _table(phases, load.outcomes)
        if any(_suspicious(o) for o in load.outcomes):
            router_logs.append(f"===== router logs at the end\n{_router_logs(cluster, namespace)}")
        with capsys.disabled():
            print("\n" + table)
            for logs in router_logs:
                print(logs)
    assert len(load.outcomes) > 10 * len(phases), table
    for phase in phases:
        assert any(o.ok for o in load.outcomes if o.phase == phase.name), f"nothing served during {phase.name}\n{table}"
    unexpected = [o for o in load.outcomes if _suspicious(o)]
    assert not unexpected, (
        f"requests failed other than streams started on a killed or wedged decode pod "
        f"(router logs printed above):\n{table}"
    )
    for name in DECODE_FAULTS:
        lost = [o for o in load.outcomes if not o.ok and o.phase == name]
        assert len(lost) <= CONCURRENCY, f"more failures than requests in flight in {name}:\n{table}"
    assert not problems, "\n".join(problems) + "\n" + table


def _table(phases: list[Phase], outcomes: list[Outcome]) -> str:
    lines = [f"{'phase':<24} {'sent':>5} {'ok':>5} {'failed':>6} {'retried':>7} {'seconds':>7}  detail", "-" * 100]
    for phase in phases:
        mine = [o for o in outcomes if o.phase == phase.name]
        lines.append(
            f"{phase.name:<24} {len(mine):>5} {sum(o.ok for o in mine):>5} "
            f"{sum(not o.ok for o in mine):>6} {sum(o.connect_retries > 0 for o in mine):>7} "
            f"{phase.seconds:>7.1f}  {phase.detail}"
        )
    failures = [o for o in outcomes if not o.ok]
    lines.append(f"{'total':<24} {len(outcomes):>5} {sum(o.ok for o in outcomes):>5} {len(failures):>6}")
    for failure in failures:
        lines.append(f"  failed in {failure.phase!r} ({'stream' if failure.stream else 'plain'}): {failure.reason}")
    return "\n".join(lines)
