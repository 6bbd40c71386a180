"""A prompt a decode pod computes itself (short, overflowed, or no prefill pod to take it) goes
where its leading blocks went before, within a small slack of KV headroom
(:func:`splitserve_runtime.router.policy.choose_decode`); and a pod discovery removes leaves
the affinity index.

Two small HTTP upstreams stand in for decode pods (their /metrics report the KV usage the test
sets, each counts the prompts it got); the router is the real app with no prefill pod, so every
prompt is computed on a decode pod.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from threaded_server import ThreadedServer, aggregated_pod_app

from splitserve_contract import Metric, Role, RouterArgs
from splitserve_e2e.net import free_port
from splitserve_e2e.process import wait_until
from splitserve_runtime.router.discovery import parse_static
from splitserve_runtime.router.pods import PodSet
from splitserve_runtime.router.policy import (
    DECODE_AFFINITY_SLACK,
    Candidate,
    PodLoad,
    PrefillSelector,
    choose_decode,
)

SYSTEM = "You are a helpful assistant. " * 40
"""A shared prefix of many blocks for the router's fallback tokenizer (4-byte chunks)."""


@dataclass
class DecodePod:
    kv: float = 0.0
    prompts: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> FastAPI:
        app: FastAPI = aggregated_pod_app(
            role="decode",
            metrics_text=lambda: (  # typed: mypy does not resolve the helper
                f"# TYPE {Metric.KV_CACHE_USAGE_RATIO} gauge\n{Metric.KV_CACHE_USAGE_RATIO} {self.kv}\n"
            ),
        )

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict[str, Any]:
            body = await request.json()
            with self.lock:
                self.prompts.append(str(body["prompt"]))
            return {"id": "d", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]}

        return app


@pytest.fixture
def router() -> Iterator[tuple[str, Any, DecodePod, DecodePod, list[str]]]:
    """(router URL, its app, decode pod a, decode pod b, their pod names)."""
    from splitserve_runtime.router.app import build_app, byte_chunk_tokens

    a, b = DecodePod(), DecodePod()
    ports = [free_port(), free_port()]
    router_port = free_port()
    args = RouterArgs(
        discovery="static",
        decode_endpoints=",".join(f"127.0.0.1:{p}" for p in ports),
        short_prompt_threshold=8,
        health_interval_seconds=0.1,
    )
    app = build_app(args=args, tokenize=lambda path, body: byte_chunk_tokens(str(body.get("prompt", ""))))
    with ThreadedServer(a.app(), ports[0]), ThreadedServer(b.app(), ports[1]), ThreadedServer(app, router_port):
        yield f"http://127.0.0.1:{router_port}", app, a, b, [f"127.0.0.1:{p}" for p in ports]


def _polled(app: Any, names: list[str], kv: tuple[float, float]) -> bool:
    pods = [app.state.pods.get(name) for name in names]
    return all(p is not None and p.healthy and p.load.kv_cache_usage_ratio == v for p, v in zip(pods, kv, strict=True))


def _set_kv(app: Any, a: DecodePod, b: DecodePod, names: list[str], kv: tuple[float, float]) -> None:
    a.kv, b.kv = kv
    wait_until(lambda: _polled(app, names, kv), timeout_seconds=10, what=f"the router polling KV usage {kv}")


def _send(url: str, prompt: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200, answer.text


def test_a_shared_prefix_stays_on_the_decode_pod_that_computed_it_within_the_slack(
    router: tuple[str, Any, DecodePod, DecodePod, list[str]],
) -> None:
    url, app, a, b, names = router
    _set_kv(app, a, b, names, (0.0, 0.05))
    _send(url, SYSTEM + "first question")
    assert len(a.prompts) == 1 and b.prompts == []  # the most headroom: a
    _set_kv(app, a, b, names, (0.05, 0.0))
    _send(url, SYSTEM + "second question")
    assert len(a.prompts) == 2 and b.prompts == []  # a has its blocks, within the slack of b
    _send(url, "an unrelated prompt " * 40)
    assert len(b.prompts) == 1  # no blocks anywhere: the most headroom
    _set_kv(app, a, b, names, (0.05 + 2 * DECODE_AFFINITY_SLACK, 0.0))
    _send(url, SYSTEM + "third question")
    assert len(a.prompts) == 2 and len(b.prompts) == 2  # a is too full to be worth the blocks


def test_choose_decode_keeps_headroom_first_without_blocks() -> None:
    pods = [
        Candidate(name="d0", load=PodLoad(kv_cache_usage_ratio=0.05)),
        Candidate(name="d1", load=PodLoad(kv_cache_usage_ratio=0.0)),
    ]
    assert choose_decode(candidates=pods, matched_blocks=lambda name: 0) == "d1"
    assert choose_decode(candidates=pods, matched_blocks=lambda name: 3 if name == "d0" else 0) == "d0"
    assert (
        choose_decode(candidates=pods, matched_blocks=lambda name: 3 if name == "d0" else 0, exclude=frozenset({"d0"}))
        == "d1"
    )
    full = [Candidate(name="d0", load=PodLoad(kv_cache_usage_ratio=0.5)), pods[1]]
    assert choose_decode(candidates=full, matched_blocks=lambda name: 30 if name == "d0" else 0) == "d1"


def test_a_pod_discovery_removes_leaves_the_affinity_index() -> None:
    """Pod names are unique per pod, so without this every pod the autoscaler ever started
    would keep up to 4,096 block hashes in the router for its lifetime."""
    from splitserve_runtime.router.app import build_app

    app = build_app(args=RouterArgs(discovery="static", decode_endpoints="127.0.0.2:8000,127.0.0.3:8000"))
    pods: PodSet = app.state.pods
    selector: PrefillSelector = app.state.selector
    hashes = [b"h1", b"h2"]
    for name in ("127.0.0.2:8000", "127.0.0.3:8000"):
        selector.record(pod=name, hashes=hashes)
    pods.set_targets(role=Role.DECODE, targets=parse_static(role=Role.DECODE, endpoints="127.0.0.3:8000"))
    assert selector.index.matched_blocks(pod="127.0.0.2:8000", hashes=hashes) == 0
    assert selector.index.matched_blocks(pod="127.0.0.3:8000", hashes=hashes) == 2
