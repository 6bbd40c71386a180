"""The kopf handlers' reconciles run on their own threads (:data:`handlers.SPEC_WORKERS`), in the
handler's context, as :func:`asyncio.to_thread` would run them (what kopf puts there, its
per-object logging prefixes, carries on into the reconcile)."""

from __future__ import annotations

import concurrent.futures
import contextvars

from splitserve_operator import handlers

HANDLER_CONTEXT: contextvars.ContextVar[str] = contextvars.ContextVar("handler_context")


async def test_a_lane_runs_in_the_callers_context() -> None:
    HANDLER_CONTEXT.set("the handler's")
    with concurrent.futures.ThreadPoolExecutor(1) as lane:
        assert await handlers.in_lane(lane, HANDLER_CONTEXT.get) == "the handler's"
