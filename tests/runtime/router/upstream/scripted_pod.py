"""A scripted pod for the router's upstream tests: a raw asyncio HTTP server on loopback whose
handler the test writes, and the helpers to read a request and write chunked bodies."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Pod:
    """A scripted pod: ``handler`` serves each connection; ``connections`` counts them."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> Pod:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


# ------------------------------------------------------------------ scripts both clients face
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST_EVENT = b"data: first\n\n"
SECOND_EVENT = b"data: second\n\n"


def two_events(go_on: asyncio.Event) -> Handler:
    """A stream whose second event (and end) comes only once ``go_on`` is set."""

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunked(FIRST_EVENT))
        await writer.drain()
        await go_on.wait()  # the second event only after the client has the first
        writer.write(chunked(SECOND_EVENT) + b"0\r\n\r\n")
        await writer.drain()

    return stream


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the request and closes without a byte, as a pod dropping an idle connection."""
    await read_request(reader)


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await asyncio.sleep(5)


async def die_after_first_event(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(STREAM_HEAD + chunked(FIRST_EVENT))
    await writer.drain()  # then the connection closes in the middle of the stream


async def endless_streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every request on the connection gets a stream's first event, and no end."""
    while True:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunked(FIRST_EVENT))
        await writer.drain()
