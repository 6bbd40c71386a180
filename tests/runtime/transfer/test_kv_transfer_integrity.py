"""The zero-copy KV transport's own promises, over real loopback sockets.

- A block received straight into a destination (:class:`BlockDestination`, scattered over
  several buffers) arrives intact, in order, and only the blocks asked for.
- One flipped byte anywhere in a BLOCK frame on the wire (payload, index, CRC, header) ends the
  pull with a ``corrupt`` TransferError, and neither a plain sink nor a destination is told of
  the bad block or any after it.
- A puller that stops reading does not make the prefill side read (and hold) the whole
  request: it reads a bounded number of blocks ahead, then gives up after its I/O timeout.
- Received in arbitrary pieces (the CRC is folded in chunk by chunk as they arrive), blocks
  come out intact, and a flipped byte is still caught.
- A refused puller reads the server's ERROR frame and a clean end, even when it sent more than
  the server read (closing over unread bytes would reset the connection instead).
- The CRC is the standard CRC-32 whichever library computes it, so pods with and without the
  accelerated one agree on every byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
import zlib
from collections.abc import Sequence

import pytest

from splitserve_runtime.transfer import (
    BlockDestination,
    ExportedKV,
    HandoffAuth,
    HandoffKey,
    KVExportRegistry,
    KVLayout,
    TcpKVConnector,
    TcpKVServer,
    TransferError,
    framing,
)
from splitserve_runtime.transfer.framing import FrameError, FrameType
from splitserve_runtime.transfer.receive import BlockReceiver
from splitserve_runtime.transfer.wire import Channel

LAYOUT = KVLayout(
    num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32", dtype_bytes=4, compat_hash="integrity"
)  # 2 KiB blocks
NUM_BLOCKS = 6
# no block holds the frame magic, so a flipped byte is found where the test put it
BLOCKS = [bytes((17 * i + j) % 251 for j in range(LAYOUT.block_nbytes)) for i in range(NUM_BLOCKS)]
NUM_TOKENS = NUM_BLOCKS * LAYOUT.block_size - 1
FRAME_BYTES = framing.BLOCK_HEADER_SIZE + LAYOUT.block_nbytes


class CacheDestination:
    """A destination scattering each block over three uneven buffers of its slot."""

    def __init__(self) -> None:
        self.memory = bytearray(NUM_BLOCKS * LAYOUT.block_nbytes)
        self.asked: list[int] = []
        self.arrived: list[int] = []

    def slot(self, index: int) -> memoryview:
        return memoryview(self.memory)[index * LAYOUT.block_nbytes : (index + 1) * LAYOUT.block_nbytes]

    def buffers(self, index: int) -> Sequence[memoryview]:
        self.asked.append(index)
        slot = self.slot(index)
        return [slot[:7], slot[7:1000], slot[1000:]]

    def received(self, index: int) -> None:
        self.arrived.append(index)


async def _serve(
    *,
    io_timeout_seconds: float = 2.0,
    blocks: list[bytes] = BLOCKS,
    reads: list[int] | None = None,
    observed: list[tuple[int, float, bool]] | None = None,
) -> TcpKVServer:
    registry = KVExportRegistry(ttl_seconds=30)

    def read_block(index: int) -> memoryview:
        if reads is not None:
            reads.append(index)
        return memoryview(blocks[index])

    registry.add(
        ExportedKV(
            request_id="r",
            num_tokens=len(blocks) * LAYOUT.block_size - 1,
            num_blocks=len(blocks),
            read_block=read_block,
            release=lambda: None,
        )
    )
    server = TcpKVServer(
        registry=registry,
        layout=LAYOUT,
        host="127.0.0.1",
        port=0,
        io_timeout_seconds=io_timeout_seconds,
        observer=(lambda b, s, ok: observed.append((b, s, ok))) if observed is not None else None,
    )
    await server.start()
    return server


def test_the_destination_protocol_is_recognised_and_a_plain_sink_is_not() -> None:
    assert isinstance(CacheDestination(), BlockDestination)
    assert not isinstance(lambda i, d: None, BlockDestination)


async def test_blocks_land_in_their_destination_scattered_in_place() -> None:
    server = await _serve()
    destination = CacheDestination()
    try:
        result = await TcpKVConnector().fetch(
            endpoint=f"127.0.0.1:{server.port}",
            request_id="r",
            first_block=2,
            layout=LAYOUT,
            on_block=destination,
            timeout_seconds=2.0,
            expected_num_tokens=NUM_TOKENS,
        )
    finally:
        await server.stop()
    assert destination.asked == destination.arrived == list(range(2, NUM_BLOCKS))
    assert [bytes(destination.slot(i)) for i in range(2, NUM_BLOCKS)] == BLOCKS[2:]
    assert bytes(destination.slot(0)) == bytes(destination.slot(1)) == bytes(LAYOUT.block_nbytes)
    assert result.num_blocks == NUM_BLOCKS - 2 and result.num_tokens == NUM_TOKENS


async def test_a_destination_offering_the_wrong_room_is_a_programming_error() -> None:
    class Short(CacheDestination):
        def buffers(self, index: int) -> Sequence[memoryview]:
            return [memoryview(bytearray(LAYOUT.block_nbytes - 1))]

    class ReadOnly(CacheDestination):
        def buffers(self, index: int) -> Sequence[memoryview]:
            return [memoryview(bytes(LAYOUT.block_nbytes))]

    server = await _serve()
    try:
        for destination in (Short(), ReadOnly()):
            with pytest.raises(ValueError, match="not 2048 writable bytes"):
                await TcpKVConnector().fetch(
                    endpoint=f"127.0.0.1:{server.port}",
                    request_id="r",
                    first_block=0,
                    layout=LAYOUT,
                    on_block=destination,
                    timeout_seconds=2.0,
                )
    finally:
        await server.stop()


class FlippingProxy:
    """Forwards one connection to ``upstream``, flipping (XOR 0xFF) the byte at
    ``offset_in_blocks`` counted from the first BLOCK frame of the server's answer."""

    def __init__(self, *, upstream: int, offset_in_blocks: int) -> None:
        self._upstream = upstream
        self._offset = offset_in_blocks
        self._server: asyncio.Server | None = None
        self.flipped = False

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._upstream)

        async def upstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await client_reader.read(65536):
                    server_writer.write(data)
                    await server_writer.drain()
            server_writer.close()

        async def downstream() -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                layout_header = await server_reader.readexactly(framing.HEADER_SIZE)
                _, _, _, _, payload_len, _ = framing.HEADER.unpack(layout_header)
                client_writer.write(layout_header + await server_reader.readexactly(payload_len))
                position = 0  # from the first BLOCK frame on
                while data := await server_reader.read(65536):
                    if position <= self._offset < position + len(data):
                        chunk = bytearray(data)
                        chunk[self._offset - position] ^= 0xFF
                        data = bytes(chunk)
                        self.flipped = True
                    position += len(data)
                    client_writer.write(data)
                    await client_writer.drain()
            client_writer.close()

        await asyncio.gather(upstream(), downstream())


BAD_BLOCK = 3
FLIPS = {
    "block payload, first byte": framing.BLOCK_HEADER_SIZE,
    "block payload, middle": framing.BLOCK_HEADER_SIZE + LAYOUT.block_nbytes // 2,
    "block payload, last byte": FRAME_BYTES - 1,
    "block index": framing.HEADER_SIZE + 3,
    "header CRC": framing.HEADER_SIZE - 1,
    "header length": 10,
    "header type": 5,
    "header magic": 0,
}


@pytest.mark.parametrize("into", ["sink", "destination"])
@pytest.mark.parametrize("where", list(FLIPS))
async def test_one_flipped_byte_on_the_wire_fails_the_pull_before_the_block_is_used(where: str, into: str) -> None:
    server = await _serve()
    proxy = FlippingProxy(upstream=server.port, offset_in_blocks=BAD_BLOCK * FRAME_BYTES + FLIPS[where])
    port = await proxy.start()
    sunk: list[tuple[int, bytes]] = []
    destination = CacheDestination()
    try:
        with pytest.raises(TransferError) as info:
            await TcpKVConnector().fetch(
                endpoint=f"127.0.0.1:{port}",
                request_id="r",
                first_block=0,
                layout=LAYOUT,
                on_block=destination if into == "destination" else (lambda i, d: sunk.append((i, bytes(d)))),
                timeout_seconds=2.0,
                expected_num_tokens=NUM_TOKENS,
            )
    finally:
        await proxy.stop()
        await server.stop()
    assert proxy.flipped
    assert info.value.code == "corrupt", info.value
    if where.startswith("block payload") or where == "header CRC":
        assert "CRC" in info.value.message
    # every block before the bad one arrived whole; the bad one and those after never did
    if into == "sink":
        assert sunk == [(i, BLOCKS[i]) for i in range(BAD_BLOCK)]
    else:
        assert destination.arrived == list(range(BAD_BLOCK))
        assert [bytes(destination.slot(i)) for i in range(BAD_BLOCK)] == BLOCKS[:BAD_BLOCK]


async def test_a_puller_that_stops_reading_bounds_what_the_server_reads_ahead() -> None:
    big = KVLayout(**{**LAYOUT.to_json(), "num_layers": 512})  # 512 KiB blocks
    blocks = [bytes([i]) * big.block_nbytes for i in range(128)]  # 64 MiB in all
    registry = KVExportRegistry(ttl_seconds=30)
    reads: list[int] = []
    observed: list[tuple[int, float, bool]] = []

    def read_block(index: int) -> memoryview:
        reads.append(index)
        return memoryview(blocks[index])

    registry.add(
        ExportedKV(
            request_id="big",
            num_tokens=len(blocks) * big.block_size,
            num_blocks=len(blocks),
            read_block=read_block,
            release=lambda: None,
        )
    )
    server = TcpKVServer(
        registry=registry,
        layout=big,
        host="127.0.0.1",
        port=0,
        io_timeout_seconds=0.5,
        observer=lambda b, s, ok: observed.append((b, s, ok)),
    )
    await server.start()
    puller = socket.socket()
    try:
        puller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        puller.connect(("127.0.0.1", server.port))
        puller.sendall(
            framing.encode_json(FrameType.FETCH, {"request_id": "big", "first_block": 0, "layout": big.to_json()})
        )
        started = time.monotonic()  # the puller reads nothing from here on: a stalled decode pod
        while not observed and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
    finally:
        puller.close()
        await server.stop()
    assert observed and observed[0][2] is False  # the server gave up on the stalled puller
    assert 0 < len(reads) <= 32, f"the server read {len(reads)} of 128 blocks for a puller that read none"


async def _trickle(stream: bytes, *, seed: int, into: str) -> tuple[list[int], CacheDestination]:
    """Feed ``stream`` to a BlockReceiver through a socket in random pieces of 1..3000 bytes,
    letting the receiver run between them; returns the blocks the sink saw, and the cache."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    rng = random.Random(seed)
    destination = CacheDestination()
    sunk: list[int] = []

    def sink(index: int, data: memoryview) -> None:
        destination.slot(index)[:] = data
        sunk.append(index)

    async def send() -> None:
        position = 0
        while position < len(stream):
            piece = stream[position : position + rng.randint(1, 3000)]
            await asyncio.get_running_loop().sock_sendall(theirs, piece)
            position += len(piece)
            await asyncio.sleep(0)

    channel = Channel(ours)
    receiver = BlockReceiver(
        channel=channel,
        block_nbytes=LAYOUT.block_nbytes,
        timeout_seconds=2.0,
        first_block=1,
        num_blocks=NUM_BLOCKS,
        on_block=destination if into == "destination" else sink,
    )
    sending = asyncio.create_task(send())
    try:
        await receiver.receive()
        await sending
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        channel.close()
        theirs.close()
    return (destination.arrived if into == "destination" else sunk), destination


def _frames(first_block: int) -> bytes:
    return b"".join(framing.block_header(index=i, data=BLOCKS[i]) + BLOCKS[i] for i in range(first_block, NUM_BLOCKS))


@pytest.mark.parametrize("into", ["sink", "destination"])
@pytest.mark.parametrize("seed", range(4))
async def test_blocks_received_in_arbitrary_pieces_come_out_intact(seed: int, into: str) -> None:
    arrived, cache = await _trickle(_frames(1) + framing.encode_json(FrameType.DONE, {}), seed=seed, into=into)
    assert arrived == list(range(1, NUM_BLOCKS))
    assert [bytes(cache.slot(i)) for i in range(1, NUM_BLOCKS)] == BLOCKS[1:]


@pytest.mark.parametrize("into", ["sink", "destination"])
@pytest.mark.parametrize("seed", range(4))
async def test_a_flipped_byte_is_caught_however_the_bytes_arrive(seed: int, into: str) -> None:
    stream = bytearray(_frames(1))
    where = random.Random(seed).randrange(FRAME_BYTES + framing.BLOCK_HEADER_SIZE, 2 * FRAME_BYTES)
    stream[where] ^= 0x01  # in block 2's bytes: blocks 1 before it is fine
    with pytest.raises(FrameError, match="CRC"):
        await _trickle(bytes(stream), seed=seed, into=into)


@pytest.mark.parametrize("request_bytes", ["unauthenticated FETCH", "bad CRC"])
async def test_a_refused_puller_gets_a_clean_end_not_a_reset(request_bytes: str) -> None:
    registry = KVExportRegistry(ttl_seconds=30)
    server = TcpKVServer(
        registry=registry,
        layout=LAYOUT,
        host="127.0.0.1",
        port=0,
        io_timeout_seconds=2.0,
        auth=HandoffAuth(key=HandoffKey(b"k" * 32)),
    )
    await server.start()
    fetch = framing.encode_json(FrameType.FETCH, {"request_id": "r", "first_block": 0, "layout": LAYOUT.to_json()})
    if request_bytes == "bad CRC":
        fetch = (
            fetch[: framing.HEADER_SIZE - 1]
            + bytes([fetch[framing.HEADER_SIZE - 1] ^ 1])
            + fetch[framing.HEADER_SIZE :]
        )
    answers: list[bytes] = []
    try:
        for _ in range(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(fetch + os.urandom(20000))  # more than the server will read
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(), timeout=5))  # no ConnectionResetError
            writer.close()
    finally:
        await server.stop()
    if request_bytes == "bad CRC":  # nothing to say to a peer that does not speak the protocol
        assert answers == [b""] * 10
    else:
        for answer in answers:
            header = framing.decode_header(answer[: framing.HEADER_SIZE], max_payload_bytes=1 << 16)
            assert header.type is FrameType.ERROR and len(answer) == framing.HEADER_SIZE + header.payload_len
            assert b'"unauthorized"' in answer


def test_the_crc_is_standard_crc32_whichever_library_computes_it() -> None:
    data = os.urandom(1 << 20)
    assert framing.crc32(data) == zlib.crc32(data)
    assert framing.crc32(data[1000:], framing.crc32(data[:1000])) == zlib.crc32(data)
    assert framing.CRC32_IMPLEMENTATION in ("zlib", "zlib-ng")


async def test_a_peer_speaking_another_version_is_refused_clearly() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        frame = bytearray(framing.encode_json(FrameType.LAYOUT, {"num_blocks": 1}))
        frame[4] = framing.VERSION + 1
        writer.write(bytes(frame))
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    async with server:
        with pytest.raises(TransferError) as info:
            await TcpKVConnector().fetch(
                endpoint=f"127.0.0.1:{server.sockets[0].getsockname()[1]}",
                request_id="r",
                first_block=0,
                layout=LAYOUT,
                on_block=lambda i, d: None,
                timeout_seconds=1.0,
            )
    assert info.value.code == "corrupt"
    assert f"unsupported frame version {framing.VERSION + 1}" in info.value.message
    assert "same image" in info.value.message
