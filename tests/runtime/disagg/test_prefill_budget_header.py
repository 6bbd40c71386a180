"""A prefill pod named in a picker header has one total budget to hand the request over.

Defect pinned: a decode pod behind a Gateway sent the prefill request to the header-named pod
with a 600 s read timeout, so a pod that accepted the connection and never answered (or dripped
one byte a second, which resets any read-gap timeout) held the client's request for ten minutes.
Now the whole prefill stage, the identity GET included, ends at the budget, and the request is
computed on the decode pod (counted as a failed KV transfer).

The named pods are real listeners on loopback: one accepts and never sends a byte, one answers
a status line and then drips one byte a second. The :class:`Prefiller` is the decode pod's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from starlette.datastructures import Headers

from splitserve_contract import Metric, Role
from splitserve_runtime.disagg.prefiller import Prefiller
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.transfer.auth import HandoffAuth, HandoffKey

BUDGET_SECONDS = 1.5


async def _stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts, reads what it is sent, answers nothing (until the caller hangs up)."""
    try:
        while await reader.read(65536):
            pass
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers a status line and headers at once, then one body byte a second."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        for _ in range(3600):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(1.0)
    except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


@asynccontextmanager
async def _listener(handler: object) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()


def _failures(metrics: ServerMetrics) -> float:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == Metric.KV_TRANSFER_FAILURES_TOTAL
    )


@pytest.mark.parametrize("keyed", [True, False], ids=["identity-get-stalls", "loopback-post-stalls"])
@pytest.mark.parametrize("handler", [_stall, _drip], ids=["stalled", "dripping"])
def test_a_stalled_or_dripping_named_pod_ends_within_the_budget(handler: object, keyed: bool) -> None:
    metrics = ServerMetrics(role=Role.DECODE.value, model="m", stats_source=lambda: None)
    auth = HandoffAuth(key=HandoffKey(b"k" * 32) if keyed else None)

    async def scenario() -> tuple[float, object]:
        prefiller = Prefiller(metrics=metrics, budget_seconds=BUDGET_SECONDS)
        try:
            async with _listener(handler) as endpoint:
                started = time.monotonic()
                prefilled = await asyncio.wait_for(
                    prefiller.prefill(
                        path="/v1/completions",
                        body={"model": "m", "prompt": "hello"},
                        endpoints=[endpoint],
                        headers=Headers({"authorization": "Bearer sk"}),
                        request_id="r1",
                        auth=auth,
                    ),
                    timeout=30,
                )
                return time.monotonic() - started, prefilled.params
        finally:
            await prefiller.aclose()

    before = _failures(metrics)
    elapsed, params = asyncio.run(scenario())
    assert params is None  # the prompt is computed on the decode pod
    assert BUDGET_SECONDS - 0.1 <= elapsed < BUDGET_SECONDS + 2, elapsed
    assert _failures(metrics) == before + 1
