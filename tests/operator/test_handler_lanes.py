"""The kopf handlers' reconciles run on their own threads (:data:`handlers.SPEC_WORKERS`), in the
handler's context: kopf finds its Event poster there, so an Event posted from such a reconcile
reaches the API server instead of only the log."""

from __future__ import annotations

import concurrent.futures
import contextvars

from splitserve_operator import handlers

HANDLER_CONTEXT: contextvars.ContextVar[str] = contextvars.ContextVar("handler_context")


async def test_a_lane_runs_in_the_callers_context() -> None:
    HANDLER_CONTEXT.set("the handler's")
    with concurrent.futures.ThreadPoolExecutor(1) as lane:
        assert await handlers.in_lane(lane, HANDLER_CONTEXT.get) == "the handler's"
