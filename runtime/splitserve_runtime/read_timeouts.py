"""Deadlines for reading a request, for the runtime's and the router's HTTP servers.

uvicorn bounds only the idle time *between* requests on a keep-alive connection
(``timeout_keep_alive``). A client that connects and sends nothing, or half a request line, or
its headers and then none of the body it announced, held its connection (a socket, a parser,
and for a body a task waiting in ``receive()``) for as long as it liked: 20,000 such
connections were all still open minutes later. :func:`http_protocol` is uvicorn's httptools
protocol with two more timers, driven by the parser's own callbacks:

- **headers**: a request's line and headers must be complete within ``header_timeout_seconds``
  of its first byte (of the connection, for the first request: a connection that sends nothing
  is closed as well). The bound is on the whole head, not between bytes, so trickling headers
  a byte at a time does not extend it;
- **body**: while a request's body is being read, each pause between its bytes must be shorter
  than ``body_idle_timeout_seconds`` (an idle bound, as nginx's ``client_body_timeout``: a large
  body on a slow link is fine as long as it moves).

A request that ran out of time is answered ``408`` in the OpenAI error shape (code
``request_timeout``) where nothing was answered yet, and the connection is closed; the
application, if it was waiting for the body, sees a disconnect. Time the server itself takes
is never charged to the client: while reading is paused by the server (a pipelined request
waits for the answer before it, or a body the application has not taken yet) or an earlier
request on the connection is still being answered, the timers start again instead of firing.

Like :mod:`.body_limit` this sits outside the runtime's layers: the server and the router
both serve through it (``uvicorn.Config(http=...)``); the bounds are the flags
``--header-timeout-seconds`` and ``--body-idle-timeout-seconds`` of both (0: no bound).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


def request_timeout_response(message: str) -> bytes:
    """A whole ``408`` HTTP/1.1 response that closes the connection, body in the OpenAI shape."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
    ).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


class DeadlineHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header and body deadlines of the module docstring.
    Use :func:`http_protocol` for a subclass with the bounds set (0: no bound)."""

    header_timeout_seconds: float = 0.0
    body_idle_timeout_seconds: float = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading: str = ""
        """What the running timer bounds: "headers", "body" or "" (none runs)."""
        self._request_begun = False
        """Bytes of a request whose headers are not complete have arrived."""

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection is another protocol's from here
        super().handle_websocket_upgrade()

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._arm("headers")

    def on_headers_complete(self) -> None:
        self._request_begun = False
        self._arm("body")  # until the body's first bytes; a request without one completes now
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm("body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    # ------------------------------------------------------------------ timers
    def _arm(self, reading: str) -> None:
        self._disarm()
        seconds = self.header_timeout_seconds if reading == "headers" else self.body_idle_timeout_seconds
        if seconds > 0:
            self._reading = reading
            self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._reading = ""

    def _expired(self) -> None:
        reading, self._deadline = self._reading, None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        earlier_in_flight = reading == "headers" and cycle is not None and not cycle.response_complete
        if self.flow.read_paused or answering or earlier_in_flight:
            self._arm(reading)  # the server's own time, not the client's
            return
        if reading == "headers":
            bound, what = self.header_timeout_seconds, "the request line and headers"
            answer = self._request_begun  # a connection that sent nothing gets no answer
        else:
            bound, what = self.body_idle_timeout_seconds, "more of the request body"
            answer = cycle is not None and not cycle.response_started
        message = f"the client sent {what} too slowly: nothing came within the server's {bound:g} s"
        log.debug("closing %s: %s", _client(self.client), message)
        if answer:
            transport.write(request_timeout_response(message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() says so; its sends are dropped
            cycle.message_event.set()
        transport.close()


def _client(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def http_protocol(*, header_timeout_seconds: float, body_idle_timeout_seconds: float) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these bounds (0: none)."""
    if header_timeout_seconds < 0 or body_idle_timeout_seconds < 0:
        raise ValueError("read timeouts must be >= 0 (0: no bound)")
    return type(
        "DeadlineHttpToolsProtocol",
        (DeadlineHttpToolsProtocol,),
        {
            "header_timeout_seconds": float(header_timeout_seconds),
            "body_idle_timeout_seconds": float(body_idle_timeout_seconds),
        },
    )
