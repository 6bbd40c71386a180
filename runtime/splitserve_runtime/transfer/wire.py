"""KV frames over one non-blocking TCP socket, with no per-block copies in Python.

Why not asyncio streams: a StreamReader copies every byte it receives twice (into its buffer,
then out as a new ``bytes``), and the receiving side then copied the block once more into the
cache; Python 3.11's ``StreamWriter.writelines`` joins its buffers into one. That put the
connector at about 0.7x of a plain socket copy. Here:

- a send gathers frame headers and the blocks' own memory in one ``sendmsg`` (the kernel
  reads the block where it lies: the exporter's buffer, no Python copy);
- a receive scatters with ``recvmsg_into`` straight into the buffers it is given (the decode
  side's destination block), followed by a small spill buffer that catches the start of the
  next frame in the same system call; those few bytes are copied out of it, nothing else.

Waiting for the socket uses the running event loop (``add_reader``/``add_writer``), so a
transfer never blocks the loop. Waits are bounded by a deadline the caller sets for what
follows (:meth:`Channel.expire_in`, typically once per frame): it costs nothing while the
socket has data, where ``asyncio.timeout`` around every block would arm and cancel a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from .framing import HEADER_SIZE, Frame, Header, check_crc, crc32, decode_header

SPILL_BYTES = 4096
"""Room after the destination for the next frame's start. Small on purpose: every byte that
lands here is copied once more, and a block frame's header is only 20 bytes."""
CLOSE_DRAIN_READS = 256
"""At most this many spill buffers' worth of unread input are discarded at close (1 MiB)."""
try:
    MAX_IOVECS = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):  # no sysconf: POSIX guarantees 16
    MAX_IOVECS = 16


class PeerClosed(Exception):
    """The peer closed the connection before ``expected`` bytes had arrived."""

    def __init__(self, *, received: int, expected: int) -> None:
        super().__init__(f"peer closed after {received} of {expected} bytes")
        self.received = received
        self.expected = expected


def byte_view(buffer: Any) -> memoryview:
    """``buffer`` (bytes, bytearray, memoryview, a numpy array...) as flat unsigned bytes."""
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("a KV block must be one contiguous buffer")
        view = view.cast("B")
    return view


def consume(views: list[memoryview], first: int, count: int) -> int:
    """Account for ``count`` bytes sent from or received into ``views[first:]``: returns the
    index of the first view not done, which is trimmed to what it still lacks."""
    while count:
        head = views[first]
        if count < len(head):
            views[first] = head[count:]
            return first
        count -= len(head)
        first += 1
    return first


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class Channel:
    """One connected socket (made non-blocking here) that sends and receives frames."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the control frames
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._spill = memoryview(bytearray(SPILL_BYTES))
        self._spill_start = 0
        self._spill_end = 0
        self._header = memoryview(bytearray(HEADER_SIZE))
        self._deadline: float | None = None

    def close(self) -> None:
        """Close the socket, first discarding what the peer sent and nobody read (a refused
        FETCH, a frame cut short by an error): closing over unread bytes makes the kernel
        send a reset, which can destroy the ERROR frame just sent before the peer reads it."""
        with contextlib.suppress(OSError):
            for _ in range(CLOSE_DRAIN_READS):
                if not self._sock.recv_into(self._spill):
                    break
        self._sock.close()

    def expire_in(self, seconds: float | None) -> None:
        """Bound the waits of the calls that follow: TimeoutError once ``seconds`` from now have
        passed without them completing (None: wait for ever)."""
        self._deadline = None if seconds is None else self._loop.time() + seconds

    async def _ready(self, *, write: bool) -> None:
        future: asyncio.Future[None] = self._loop.create_future()
        if write:
            self._loop.add_writer(self._fd, _wake, future)
        else:
            self._loop.add_reader(self._fd, _wake, future)
        timer = None if self._deadline is None else self._loop.call_at(self._deadline, _expire, future)
        try:
            await future
        finally:
            if timer is not None:
                timer.cancel()
            if write:
                self._loop.remove_writer(self._fd)
            else:
                self._loop.remove_reader(self._fd)

    # ------------------------------------------------------------------ sending
    async def send(self, buffers: Sequence[Any]) -> int:
        """Send every byte of ``buffers`` in order (gathered, not joined); returns the count."""
        views = [view for view in map(byte_view, buffers) if len(view)]
        total = sum(len(view) for view in views)
        first = 0
        while first < len(views):
            try:
                sent = self._sock.sendmsg(views[first : first + MAX_IOVECS])
            except (BlockingIOError, InterruptedError):
                await self._ready(write=True)
                continue
            first = consume(views, first, sent)
        return total

    async def send_frames(self, frames: Iterable[Sequence[Any]], *, ahead_bytes: int, stall_seconds: float) -> int:
        """Send the buffers of every item of ``frames`` in order; returns the bytes sent.

        Items are drawn from ``frames`` only as the socket takes bytes, until ``ahead_bytes``
        wait in the queue (so a lazy iterator bounds what is read ahead of a slow peer), and
        mostly while the socket is full: the work of producing the next frames (reading a
        block, its CRC) then overlaps the peer's draining of the last ones. Each
        ``ahead_bytes`` must go within ``stall_seconds`` (else TimeoutError): a long transfer
        has no overall deadline, a peer that stops reading is given up on."""
        items = iter(frames)
        rearm_at = 0
        queue: list[memoryview] = []
        first = 0
        queued = 0
        total = 0
        exhausted = False
        while True:
            while not exhausted and queued < ahead_bytes:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                for view in map(byte_view, item):
                    if len(view):
                        queue.append(view)
                        queued += len(view)
            if first == len(queue):
                return total
            if total >= rearm_at:
                self.expire_in(stall_seconds)
                rearm_at = total + ahead_bytes
            try:
                sent = self._sock.sendmsg(queue[first : first + MAX_IOVECS])
            except (BlockingIOError, InterruptedError):
                await self._ready(write=True)
                continue
            total += sent
            queued -= sent
            first = consume(queue, first, sent)
            if first >= 1024:
                del queue[:first]
                first = 0

    # ------------------------------------------------------------------ receiving
    async def recv_some(self, views: Sequence[memoryview]) -> int:
        """Receive into ``views`` (writable byte views, filled in order, not all empty) what
        there is, at least one byte unless the peer closed (then 0): bytes that came early first, else one
        system call, waiting for the socket as needed. Bytes past ``views`` are kept for the
        next call (at most :data:`SPILL_BYTES`)."""
        start, end = self._spill_start, self._spill_end
        if start < end:
            count = 0
            for view in views:
                take = min(len(view), end - start)
                view[:take] = self._spill[start : start + take]
                start += take
                count += take
                if start == end:
                    break
            self._spill_start = start
            return count
        targets = list(views[: MAX_IOVECS - 1])
        while True:
            try:
                count = self._sock.recvmsg_into([*targets, self._spill])[0]
            except (BlockingIOError, InterruptedError):
                await self._ready(write=False)
                continue
            space = sum(map(len, targets))
            if count > space:  # past the destination: the spill
                self._spill_start, self._spill_end = 0, count - space
                return space
            return count

    async def recv_into(self, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (writable byte views) exactly, in order; raises PeerClosed."""
        views = [view for view in buffers if len(view)]
        expected = sum(map(len, views))
        received = 0
        first = 0
        while first < len(views):
            count = await self.recv_some(views[first:])
            if not count:
                raise PeerClosed(received=received, expected=expected)
            received += count
            first = consume(views, first, count)

    async def read_header(self, *, max_payload_bytes: int) -> Header:
        start = self._spill_start
        if self._spill_end - start >= HEADER_SIZE:  # the usual case: it came with the last frame
            self._spill_start = start + HEADER_SIZE
            return decode_header(self._spill[start : start + HEADER_SIZE], max_payload_bytes=max_payload_bytes)
        await self.recv_into([self._header])
        return decode_header(self._header, max_payload_bytes=max_payload_bytes)

    async def read_frame(self, *, max_payload_bytes: int) -> Frame:
        """Read and verify one (control) frame. Raises FrameError or PeerClosed."""
        header = await self.read_header(max_payload_bytes=max_payload_bytes)
        payload = bytearray(header.payload_len)
        await self.recv_into([memoryview(payload)])
        check_crc(header, crc32(payload))
        return Frame(type=header.type, payload=bytes(payload))
