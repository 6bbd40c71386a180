"""Conditional disaggregation (``--prefill-overflow-tokens``): a request prefills on a decode pod
when every prefill pod has that many prompt tokens queued and the decode pod does not.

Small HTTP upstreams stand in for one prefill and one decode pod (their /metrics report the
queued prompt tokens the test sets; the prefill pod answers with handoff parameters, the decode
pod says whether it got any, i.e. whether the prompt was prefilled elsewhere); the router is the
real app. The last test takes the queue from the router's own in-flight prefill requests, which
it knows at once, before any poll.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families
from threaded_server import ThreadedServer, aggregated_pod_app

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric, RouterArgs
from splitserve_contract.handoff import HandoffParams
from splitserve_e2e.net import free_port
from splitserve_e2e.process import wait_until

PROMPT = "x" * 8000
"""2,000 tokens for the router's fallback tokenizer (4-byte chunks)."""
LIMIT = 1000


@dataclass
class FakePod:
    role: str
    queued_tokens: float = 0.0
    prefill_seconds: float = 0.0
    hits: list[dict[str, Any]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def app(self) -> FastAPI:
        app: FastAPI = aggregated_pod_app(
            role=self.role,
            metrics_text=lambda: (  # typed: mypy does not resolve the helper
                f"# TYPE {Metric.PROMPT_TOKENS_WAITING} gauge\n{Metric.PROMPT_TOKENS_WAITING} {self.queued_tokens}\n"
            ),
        )

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.hits.append(body)
            if self.role == "prefill":
                if self.prefill_seconds:
                    await asyncio.to_thread(self.release.wait, self.prefill_seconds)
                return {
                    "id": "p",
                    "object": "text_completion",
                    "choices": [{"text": "", "index": 0}],
                    KV_TRANSFER_PARAMS_FIELD: HandoffParams(
                        remote_endpoint="127.0.0.1:1", remote_request_id="r", num_prompt_tokens=3, first_token_id=1
                    ).to_json(),
                }
            return {
                "id": "d",
                "object": "text_completion",
                "choices": [{"text": "handed-off" if KV_TRANSFER_PARAMS_FIELD in body else "local", "index": 0}],
            }

        return app


@pytest.fixture
def fleet() -> Iterator[tuple[FakePod, FakePod, int, int]]:
    prefill, decode = FakePod(role="prefill"), FakePod(role="decode")
    prefill_port, decode_port = free_port(), free_port()  # never the same port twice in a process
    with ThreadedServer(prefill.app(), prefill_port), ThreadedServer(decode.app(), decode_port):
        yield prefill, decode, prefill_port, decode_port
        prefill.release.set()


def _router_args(prefill_port: int, decode_port: int, *, limit: int) -> RouterArgs:
    return RouterArgs(
        discovery="static",
        prefill_endpoints=f"127.0.0.1:{prefill_port}",
        decode_endpoints=f"127.0.0.1:{decode_port}",
        short_prompt_threshold=8,
        prefill_overflow_tokens=limit,
        health_interval_seconds=30,
    )


def _ask(
    fleet: tuple[FakePod, FakePod, int, int], *, limit: int, prefill_queued: float, decode_queued: float = 0.0
) -> tuple[str, dict[str, float]]:
    """One completion through a fresh router: (what the decode pod answered, the routes it took:
    the counters' increase, as they are the process's)."""
    from fastapi.testclient import TestClient

    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    prefill, decode, prefill_port, decode_port = fleet
    prefill.queued_tokens, decode.queued_tokens = prefill_queued, decode_queued
    app = build_app(
        args=_router_args(prefill_port, decode_port, limit=limit),
        tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))),
    )
    with TestClient(app) as client:
        before = _routes(client.get("/metrics").text)
        answer = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
        after = _routes(client.get("/metrics").text)
    assert answer.status_code == 200, answer.text
    taken = {route: n - before.get(route, 0.0) for route, n in after.items() if n > before.get(route, 0.0)}
    return str(answer.json()["choices"][0]["text"]), taken


def _routes(metrics: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("splitserve_router_routes_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            out[route] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_full_prefill_pool_overflows_to_the_decode_pod(fleet: tuple[FakePod, FakePod, int, int]) -> None:
    prefill, decode = fleet[0], fleet[1]
    text, routes = _ask(fleet, limit=LIMIT, prefill_queued=5 * LIMIT)
    assert text == "local" and prefill.hits == []  # the decode pod computed the prompt
    assert KV_TRANSFER_PARAMS_FIELD not in decode.hits[0] and decode.hits[0]["prompt"] == PROMPT
    assert routes == {"overflow": 1.0}


def test_below_the_limit_or_with_overflow_off_the_prompt_goes_to_prefill(
    fleet: tuple[FakePod, FakePod, int, int],
) -> None:
    prefill = fleet[0]
    for limit, queued in ((LIMIT, LIMIT - 1), (0, 100 * LIMIT)):
        prefill.hits.clear()
        text, routes = _ask(fleet, limit=limit, prefill_queued=queued)
        assert text == "handed-off" and len(prefill.hits) == 1, (limit, queued)
        assert routes == {"disaggregated": 1.0}, routes


def test_a_decode_pod_at_the_limit_takes_no_overflow(fleet: tuple[FakePod, FakePod, int, int]) -> None:
    prefill = fleet[0]
    text, _ = _ask(fleet, limit=LIMIT, prefill_queued=5 * LIMIT, decode_queued=LIMIT)
    assert text == "handed-off" and len(prefill.hits) == 1


def test_the_routers_own_prefills_in_flight_count_before_any_poll(fleet: tuple[FakePod, FakePod, int, int]) -> None:
    """The pods report nothing queued; the first request's 2,000 prompt tokens, still being
    prefilled, put the prefill pod over the limit for the second, which overflows; once the
    first is answered the third goes to prefill again."""
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    prefill, decode, prefill_port, decode_port = fleet
    prefill.prefill_seconds = 30.0
    router_port = free_port()
    app = build_app(
        args=_router_args(prefill_port, decode_port, limit=LIMIT),
        tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))),
    )
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    with ThreadedServer(app, router_port):
        url = f"http://127.0.0.1:{router_port}/v1/completions"
        answers: list[str] = []
        first = threading.Thread(
            target=lambda: answers.append(httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"])
        )
        first.start()
        for _ in range(200):
            if prefill.hits:
                break
            threading.Event().wait(0.05)
        assert len(prefill.hits) == 1
        second = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
        prefill.release.set()
        first.join(timeout=60)
        third = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    assert second == "local" and answers == ["handed-off"] and third == "handed-off"
    assert len(prefill.hits) == 2 and len(decode.hits) == 3


def _healthy_pods(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "splitserve_router_healthy_pods"]
    return {sample.labels["upstream"]: sample.value for sample in family.samples}


def test_the_router_exports_the_pods_it_sends_to_by_role() -> None:
    """``splitserve_router_healthy_pods{upstream}``: what a client (or an e2e test) reads to know
    that the router will disaggregate, not only that the pods are Ready."""
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    prefill, decode = FakePod(role="prefill"), FakePod(role="decode")
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    args = RouterArgs(
        discovery="static",
        prefill_endpoints=f"127.0.0.1:{prefill_port}",
        decode_endpoints=f"127.0.0.1:{decode_port}",
        health_interval_seconds=0.1,
    )
    app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
    url = f"http://127.0.0.1:{router_port}"
    with ThreadedServer(decode.app(), decode_port), ThreadedServer(app, router_port):
        with ThreadedServer(prefill.app(), prefill_port):
            wait_until(
                lambda: _healthy_pods(url) == {"prefill": 1, "decode": 1, "aggregated": 0},
                timeout_seconds=10,
                what="both pods counted healthy",
            )
        # the prefill pod is gone: after its failed polls the router counts it out
        wait_until(
            lambda: _healthy_pods(url) == {"prefill": 0, "decode": 1, "aggregated": 0},
            timeout_seconds=10,
            what="the stopped prefill pod counted out",
        )
