"""One engine request as the HTTP layer sees it: admission, outputs, cancellation, accounting.

Both endpoints (completions and chat) drive the engine through :class:`Generation`, so the
rules live in one place:
- admission errors surface before any byte of the response is sent (the first output is
  awaited before a stream starts), so a client gets a real 400 / 429 / 503 status; so does a
  request the engine fails at its first token (a 500: non-finite logits, :mod:`.errors`);
  a later failure ends a stream with an error event;
- whatever ends the request early (client hang-up, cancellation, an exception) goes through
  :meth:`Generation.close`, which aborts it in the engine so its KV blocks are freed;
- each request is counted in flight until its last byte (SIGTERM drain waits on that) and
  ends with exactly one ``splitserve_requests_total{outcome}`` increment.

Client disconnects: Starlette cancels a *streaming* body when the client goes away, but a
plain handler keeps running after a hang-up. :func:`run_until_disconnect` therefore races
non-streaming work (and the wait for a stream's first token) against the ASGI
``http.disconnect`` message, the way vLLM's ``with_cancellation`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import Request

from splitserve_runtime.engine.errors import EngineDead, EngineError, KVTransferFailed
from splitserve_runtime.engine.outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.errors import (
    SERVER_ERROR,
    APIError,
    bad_request,
    from_engine_error,
    unavailable,
)
from splitserve_runtime.server.metrics import ServerMetrics
from splitserve_runtime.server.state import ServerState

logger = logging.getLogger(__name__)

T = TypeVar("T")

DISCONNECTED_STATUS = 499
"""nginx's "client closed request": the status of an answer nobody is left to read."""


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(*, request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    finally:
        for pending in (task, listener):
            if not pending.done():
                pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await listener


class Generation:
    """Drives one request through the engine; create, `await admit()`, iterate, `close()`."""

    def __init__(
        self,
        *,
        state: ServerState,
        metrics: ServerMetrics,
        engine: EngineClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self._state = state
        self._metrics = metrics
        self._engine = engine
        self._prompt_token_ids = prompt_token_ids
        self._params = params
        self._prompt_param = prompt_param
        self._iterator: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._admitted = False
        self._finished = False
        self._closed = False
        self._outcome: str | None = None
        self._state.request_started(request_id=request_id)

    async def admit(self) -> None:
        """Submit and wait for the first output; admission errors become APIError."""
        try:
            self._iterator = self._engine.generate(
                request_id=self.request_id, prompt_token_ids=self._prompt_token_ids, params=self._params
            )
            self._first = await self._iterator.__anext__()
            self._admitted = True
            if self._first.finish_reason == FINISH_ERROR:  # failed at its first token: the
                self._finished = True  # answer's status can still say so
                self._finish(self._first)
        except EngineError as exc:
            self._set_outcome("error" if isinstance(exc, EngineDead | KVTransferFailed) else "rejected")
            raise from_engine_error(exc, prompt_param=self._prompt_param) from None
        except StopAsyncIteration:
            self._set_outcome("error")
            raise APIError(
                status_code=500, type=SERVER_ERROR, code="internal_error", message="the engine produced no output"
            ) from None
        except ValueError as exc:  # parameter problems the engine finds at admission
            self._set_outcome("rejected")
            raise bad_request(str(exc), param=self._prompt_param) from None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs, the first one included. Raises APIError if the engine fails."""
        if self._iterator is None or self._first is None:
            raise RuntimeError("admit() must succeed before outputs()")
        output: RequestOutput | None = self._first
        while output is not None:
            self._observe(output)
            if output.finished:
                self._finished = True
                self._finish(output)
                yield output
                return
            yield output
            try:
                output = await self._iterator.__anext__()
            except StopAsyncIteration:
                output = None
            except EngineError as exc:
                self._set_outcome("error")
                raise from_engine_error(exc, prompt_param=self._prompt_param) from None
        self._finished = True
        self._set_outcome("error")
        raise unavailable("the engine stopped before the request finished", code="engine_dead")

    def _observe(self, output: RequestOutput) -> None:
        self._metrics.observe_timings(
            ttft_seconds=output.ttft_seconds, itl_seconds=output.itl_seconds, e2e_seconds=output.e2e_seconds
        )

    def _finish(self, output: RequestOutput) -> None:
        if output.finish_reason == FINISH_ERROR:
            self._set_outcome("error")
            logger.warning("request %s failed in the engine: %s", self.request_id, output.error)
            if output.error_code is not None:  # the engine's own words for this request
                raise APIError(
                    status_code=500,
                    type=SERVER_ERROR,
                    code=output.error_code,
                    message=output.error or "generation failed inside the engine",
                )
            if not self._engine.is_healthy:
                raise unavailable("the inference engine failed", code="engine_dead")
            raise APIError(
                status_code=500,
                type=SERVER_ERROR,
                code="generation_error",
                message="generation failed inside the engine",
            )
        if output.finish_reason == FINISH_ABORT:
            self._set_outcome("aborted")
            raise unavailable("the request was aborted by the server", code="aborted")
        self._set_outcome("success")

    def _set_outcome(self, outcome: str) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self._metrics.record_outcome(outcome=outcome)

    async def close(self) -> None:
        """Idempotent: abort the request in the engine unless it finished; stop counting it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._admitted and not self._finished:
                self._set_outcome("aborted")
                self._engine.abort(self.request_id)
            aclose = getattr(self._iterator, "aclose", None)  # an async generator's
            if aclose is not None:
                # shielded: Starlette cancels a disconnected stream through an anyio scope,
                # which would cancel this await again; suppress: the iterator may still be
                # running in the task being cancelled
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await aclose()
        finally:
            self._set_outcome("aborted")
            self._state.request_finished(request_id=self.request_id)
