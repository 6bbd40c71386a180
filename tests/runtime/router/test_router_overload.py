"""The router under ten times its pods' capacity: 200 or 429 with Retry-After, never a 5xx, and
nothing stuck afterwards (issue 12, "Overload").

Two aggregated runtime pods (the real engine, tiny model, CPU) each run one sequence and queue
one more (``--max-num-seqs 1 --max-queue-len 1``): four requests at a time in all. Forty clients
send at once, three rounds each, half of them streaming. A pod with a full queue answers 429;
the router tries the other pod and passes the 429 (with its Retry-After) on when both are full.
Afterwards the router's in-flight gauges and the pods' queues are back to 0 and a normal
request succeeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from threaded_server import ThreadedServer, gauges

from splitserve_contract import RouterArgs, ServeArgs
from splitserve_e2e.net import free_port

MODEL_NAME = "tiny-llama"
NUM_PODS = 2
CAPACITY = NUM_PODS * (1 + 1)  # per pod: one running, one queued
CLIENTS = 10 * CAPACITY
ROUNDS = 3


@dataclasses.dataclass
class Deployment:
    router_url: str
    pod_urls: list[str]
    pod_apps: list[Any]


@pytest.fixture(scope="module")
def deployment(model_dir: Path) -> Iterator[Deployment]:
    from splitserve_runtime.engine.async_engine import AsyncEngine
    from splitserve_runtime.router.app import build_app as build_router
    from splitserve_runtime.server.app import build_app as build_pod

    args = ServeArgs(
        model=str(model_dir),
        served_model_name=MODEL_NAME,
        host="127.0.0.1",
        device="cpu",
        attention_backend="torch",
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=32,
        block_size=16,
        max_num_seqs=1,
        max_queue_len=1,
        max_num_batched_tokens=128,
    )
    pod_apps = [
        build_pod(engine=AsyncEngine.from_args(args), served_model_name=MODEL_NAME, role="aggregated", api_key=None)
        for _ in range(NUM_PODS)
    ]
    pod_ports = [free_port() for _ in pod_apps]
    router_port = free_port()
    router_app = build_router(
        args=RouterArgs(
            discovery="static",
            policy="LeastLoad",
            served_model_name=MODEL_NAME,
            aggregated_endpoints=",".join(f"127.0.0.1:{port}" for port in pod_ports),
            health_interval_seconds=0.5,
        )
    )
    servers = [ThreadedServer(app, port) for app, port in zip(pod_apps, pod_ports, strict=True)]
    for server in servers:
        server.__enter__()
    try:
        with ThreadedServer(router_app, router_port):
            deployment = Deployment(
                router_url=f"http://127.0.0.1:{router_port}",
                pod_urls=[f"http://127.0.0.1:{p}" for p in pod_ports],
                pod_apps=pod_apps,
            )
            _wait(
                lambda: httpx.get(f"{deployment.router_url}/ready", timeout=2).status_code == 200,
                what="the router to see its pods",
            )
            yield deployment
    finally:
        for server in servers:
            server.__exit__()


def _wait(predicate: Any, *, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _client(http: httpx.AsyncClient, index: int, answers: list[tuple[int, str]]) -> None:
    for round_ in range(ROUNDS):
        body = {
            "model": MODEL_NAME,
            "prompt": f"Once upon a time, client {index} round {round_}",
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0,
            "stream": index % 2 == 0,
        }
        async with http.stream("POST", "/v1/completions", json=body) as response:
            text = (await response.aread()).decode()
            retry_after = response.headers.get("retry-after", "")
            if response.status_code == 200 and body["stream"]:
                # a stream that ended with an error event is a failure too
                ok = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                answers.append((200 if ok else 599, text[-300:]))
            elif response.status_code == 429:
                answers.append((429 if int(retry_after or 0) >= 1 else 598, text))
            else:
                answers.append((response.status_code, text))


async def _overload(router_url: str) -> list[tuple[int, str]]:
    answers: list[tuple[int, str]] = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=router_url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(_client(http, i, answers) for i in range(CLIENTS)))
    return answers


def test_ten_times_capacity_gives_200_or_429_and_leaves_nothing_stuck(deployment: Deployment) -> None:
    started = time.perf_counter()
    answers = asyncio.run(_overload(deployment.router_url))
    seconds = time.perf_counter() - started
    statuses = Counter(status for status, _ in answers)
    other = {status: n for status, n in statuses.items() if status not in (200, 429)}
    print(
        f"overload: {len(answers)} sent by {CLIENTS} clients to pods that hold {CAPACITY}, "
        f"{statuses[200]} x 200, {statuses[429]} x 429 (all with Retry-After), "
        f"other {other or 0}, in {seconds:.1f} s"
    )
    assert len(answers) == CLIENTS * ROUNDS
    assert not other, [text for status, text in answers if status not in (200, 429)][:3]
    assert statuses[200] >= CAPACITY and statuses[429] > 0  # it was an overload, and served

    # nothing stuck: the router's gauges and the pods' queues are back to 0
    _wait(
        lambda: (
            gauges(
                deployment.router_url,
                "splitserve_router_requests_in_flight",
                "splitserve_router_upstream_requests_in_flight",
            )
            == 0
        ),
        what="the router's in-flight gauges to reach 0",
        timeout_s=10,
    )
    for url, app in zip(deployment.pod_urls, deployment.pod_apps, strict=True):
        _wait(
            lambda url=url: gauges(url, "splitserve_requests_running", "splitserve_requests_waiting") == 0,
            what=f"{url}'s queue to empty",
            timeout_s=10,
        )
        assert app.state.server.num_in_flight == 0
    answer = httpx.post(
        f"{deployment.router_url}/v1/completions",
        timeout=30,
        json={"model": MODEL_NAME, "prompt": "After the storm", "max_tokens": 4},
    )
    assert answer.status_code == 200, answer.text
