"""The operator's Event poster (:mod:`splitserve_operator.events`).

Defect pinned here: Events were posted through :func:`kopf.event`, which works only inside
the task kopf runs for one watched object. A reconcile started by the Secret watch's thread,
or re-run by a coalescer task that such a request had started, found no poster: its blocker
Warning (Unschedulable, FailedCreate, InsufficientGPUCapacity) was only logged, and the next
reconcile, seeing the reason in status already, never posted it (CI: no Warning in 20 s).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from autoscaler_testing import bare_apiserver
from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract
from splitserve_operator import events, kube

NAMESPACE = kube.Kind("v1", "Namespace", "namespaces", namespaced=False)
ISVC: dict[str, Any] = {
    "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
    "kind": contract.KIND,
    "metadata": {"name": "chat", "namespace": "team-a", "uid": "0b5e-uid"},
}


class CountingKube:
    """A real :class:`kube.Kube` that counts Event creates (or a scripted failure first)."""

    def __init__(self, inner: kube.Kube | None = None, *, fail_first: int = 0, status: int = 500) -> None:
        self.inner = inner
        self.creates: list[dict[str, Any]] = []
        self.fail_first = fail_first
        self.status = status

    def create(
        self, *, kind: kube.Kind, namespace: str | None, obj: Mapping[str, Any], field_manager: str | None = None
    ) -> dict[str, Any]:
        self.creates.append(dict(obj))
        if len(self.creates) <= self.fail_first:
            raise ApiException(status=self.status, reason="scripted")
        if self.inner is None:
            return dict(obj)
        return self.inner.create(kind=kind, namespace=namespace, obj=obj, field_manager=field_manager)


def _wait(predicate: Any, timeout_seconds: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


@pytest.fixture
def installed() -> Iterator[None]:
    yield
    events.install(None)


@pytest.mark.slow
def test_an_event_from_a_plain_thread_reaches_the_api_server(tmp_path: Any, installed: None) -> None:
    with bare_apiserver(tmp_path) as server:
        real = kube.Kube(api_client=server.api_client)
        real.create(
            kind=NAMESPACE,
            namespace=None,
            obj={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}},
        )
        api = CountingKube(real)
        poster = events.EventPoster(
            api=api, component=contract.MANAGED_BY_VALUE, instance="operator-0", backoff_seconds=(0.0,)
        )
        poster.start()
        events.install(poster)
        # No kopf anywhere: a thread of its own, as the Secret watch's.
        thread = threading.Thread(
            target=lambda: events.warning(obj=ISVC, reason="Unschedulable", message="0/1 nodes: Insufficient memory")
        )
        thread.start()
        thread.join()
        # An Event in a namespace that does not exist: 404, dropped at once (not retried).
        events.normal(obj={**ISVC, "metadata": {**ISVC["metadata"], "namespace": "gone"}}, reason="Ready", message="x")
        poster.stop()
        listed = real.list(kind=kube.EVENT, namespace="team-a")
        assert [(e["type"], e["reason"], e["message"]) for e in listed] == [
            ("Warning", "Unschedulable", "0/1 nodes: Insufficient memory")
        ]
        involved = listed[0]["involvedObject"]
        assert (involved["kind"], involved["name"], involved["uid"]) == (contract.KIND, "chat", "0b5e-uid")
        assert listed[0]["source"]["component"] == contract.MANAGED_BY_VALUE
        assert len(api.creates) == 2  # one each: nothing retried


def test_a_server_error_is_retried_and_a_client_error_is_not(installed: None) -> None:
    flaky = CountingKube(fail_first=2, status=503)
    poster = events.EventPoster(api=flaky, component="c", instance="i", backoff_seconds=(0.0, 0.0, 0.0))
    poster.start()
    poster.submit(obj=ISVC, type="Warning", reason="FailedCreate", message="m")
    poster.stop()
    assert len(flaky.creates) == 3  # two 503s, then posted

    refused = CountingKube(fail_first=10, status=422)
    poster = events.EventPoster(api=refused, component="c", instance="i", backoff_seconds=(0.0, 0.0, 0.0))
    poster.start()
    poster.submit(obj=ISVC, type="Warning", reason="FailedCreate", message="m")
    poster.stop()
    assert len(refused.creates) == 1


def test_a_full_queue_drops_new_events_without_blocking(installed: None) -> None:
    api = CountingKube()
    poster = events.EventPoster(api=api, component="c", instance="i", capacity=2)  # not started
    started = time.monotonic()
    for n in range(5):
        poster.submit(obj=ISVC, type="Normal", reason=f"R{n}", message="m")
    assert time.monotonic() - started < 1.0
    poster.start()
    poster.stop()
    assert [c["reason"] for c in api.creates] == ["R0", "R1"]


def test_without_a_poster_events_are_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    events.install(None)
    with caplog.at_level("INFO", logger=events.__name__):
        events.warning(obj=ISVC, reason="Unschedulable", message="m" * 2000)
    assert "Unschedulable" in caplog.text
    assert "m" * 1021 + "..." in caplog.text  # trimmed to the Event limit
