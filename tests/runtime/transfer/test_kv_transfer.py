"""The TCP KV transport over real loopback sockets: round trips, partial fetches, leases,
and every failure the decode side must detect (corrupt, truncated, silent, wrong layout)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from splitserve_runtime.transfer import (
    ExportedKV,
    KVExportRegistry,
    KVLayout,
    TcpKVConnector,
    TcpKVServer,
    TransferError,
    framing,
)
from splitserve_runtime.transfer.framing import FrameType

LAYOUT = KVLayout(
    num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32", dtype_bytes=4, compat_hash="abc"
)


class Export:
    """A request's blocks held in memory, recording whether they were released."""

    def __init__(self, *, request_id: str, num_blocks: int) -> None:
        self.blocks = [os.urandom(LAYOUT.block_nbytes) for _ in range(num_blocks)]
        self.released = 0
        self.exported = ExportedKV(
            request_id=request_id,
            num_tokens=num_blocks * LAYOUT.block_size - 1,
            num_blocks=num_blocks,
            read_block=lambda i: memoryview(self.blocks[i]),
            release=self._release,
        )

    def _release(self) -> None:
        self.released += 1


async def _server(registry: KVExportRegistry, observed: list[tuple[int, float, bool]] | None = None) -> TcpKVServer:
    server = TcpKVServer(
        registry=registry,
        layout=LAYOUT,
        host="127.0.0.1",
        port=0,
        io_timeout_seconds=2.0,
        observer=(lambda b, s, ok: observed.append((b, s, ok))) if observed is not None else None,
    )
    await server.start(expiry_interval_seconds=0.05)
    return server


async def test_round_trip_delivers_every_block_and_releases_once() -> None:
    registry = KVExportRegistry(ttl_seconds=30)
    export = Export(request_id="r1", num_blocks=5)
    registry.add(export.exported)
    observed: list[tuple[int, float, bool]] = []
    server = await _server(registry, observed)
    received: dict[int, bytes] = {}
    try:
        result = await TcpKVConnector().fetch(
            endpoint=f"127.0.0.1:{server.port}",
            request_id="r1",
            first_block=0,
            layout=LAYOUT,
            on_block=lambda i, data: received.__setitem__(i, bytes(data)),
            timeout_seconds=2.0,
        )
        # the server releases once it has seen the connector's RELEASE, after fetch returned
        await _wait_until(lambda: export.released == 1, what="the export released")
    finally:
        await server.stop()
    assert received == dict(enumerate(export.blocks))
    assert result.num_blocks == 5 and result.num_tokens == 19
    assert result.num_bytes >= 5 * LAYOUT.block_nbytes
    assert export.released == 1 and len(registry) == 0
    assert observed and observed[0][2] is True and observed[0][0] >= 5 * LAYOUT.block_nbytes


async def test_fetch_skips_blocks_the_decode_pod_already_holds() -> None:
    registry = KVExportRegistry(ttl_seconds=30)
    export = Export(request_id="r2", num_blocks=4)
    registry.add(export.exported)
    server = await _server(registry)
    received: list[int] = []
    try:
        result = await TcpKVConnector().fetch(
            endpoint=f"127.0.0.1:{server.port}",
            request_id="r2",
            first_block=3,
            layout=LAYOUT,
            on_block=lambda i, _d: received.append(i),
            timeout_seconds=2.0,
        )
    finally:
        await server.stop()
    assert received == [3] and result.num_blocks == 1


async def test_unknown_request_and_layout_mismatch_are_reported_with_codes() -> None:
    registry = KVExportRegistry(ttl_seconds=30)
    export = Export(request_id="r3", num_blocks=1)
    registry.add(export.exported)
    server = await _server(registry)
    connector = TcpKVConnector()
    try:
        with pytest.raises(TransferError) as unknown:
            await connector.fetch(
                endpoint=f"127.0.0.1:{server.port}",
                request_id="nope",
                first_block=0,
                layout=LAYOUT,
                on_block=lambda i, d: None,
                timeout_seconds=2.0,
            )
        other = KVLayout(**{**LAYOUT.to_json(), "compat_hash": "other-model"})
        with pytest.raises(TransferError) as mismatch:
            await connector.fetch(
                endpoint=f"127.0.0.1:{server.port}",
                request_id="r3",
                first_block=0,
                layout=other,
                on_block=lambda i, d: None,
                timeout_seconds=2.0,
            )
    finally:
        await server.stop()
    assert unknown.value.code == "unknown_request"
    assert mismatch.value.code == "layout_mismatch"
    assert export.released == 0  # a failed fetch leaves the export to its lease


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lease_expires_exactly_after_the_ttl() -> None:
    clock = FakeClock()
    registry = KVExportRegistry(ttl_seconds=30, clock=clock)
    export = Export(request_id="r4", num_blocks=2)
    registry.add(export.exported)
    clock.now += 29.9
    assert registry.expire() == 0 and export.released == 0 and registry.get("r4") is not None
    clock.now += 0.1
    assert registry.expire() == 1
    assert export.released == 1 and len(registry) == 0 and registry.num_expired == 1
    assert registry.expire() == 0 and export.released == 1  # released exactly once


def test_re_adding_a_request_renews_its_lease_and_releases_the_old_export() -> None:
    clock = FakeClock()
    registry = KVExportRegistry(ttl_seconds=10, clock=clock)
    first, second = Export(request_id="r5", num_blocks=1), Export(request_id="r5", num_blocks=1)
    registry.add(first.exported)
    clock.now += 8
    registry.add(second.exported)
    assert first.released == 1 and second.released == 0
    clock.now += 8  # 16 s after the first add, 8 s after the second
    assert registry.expire() == 0 and registry.get("r5") is second.exported
    clock.now += 2
    assert registry.expire() == 1 and second.released == 1


async def test_server_expiry_task_frees_unclaimed_kv() -> None:
    """The server's periodic task calls `expire`: with a clock past the TTL, the export goes."""
    clock = FakeClock()
    registry = KVExportRegistry(ttl_seconds=30, clock=clock)
    export = Export(request_id="r4", num_blocks=2)
    registry.add(export.exported)
    server = await _server(registry)
    try:
        clock.now += 31
        await _wait_until(lambda: export.released == 1, what="the expiry task to free the export")
    finally:
        await server.stop()
    assert len(registry) == 0 and registry.num_expired == 1


async def _wait_until(predicate: Callable[[], bool], *, what: str, timeout_seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_seconds
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds} s waiting for {what}")
        await asyncio.sleep(0.01)  # poll interval of this bounded wait, not a synchronisation


async def _fake_prefill(handler) -> tuple[asyncio.Server, int]:  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _fetch_from(port: int, *, timeout_seconds: float = 1.0) -> TransferError:
    with pytest.raises(TransferError) as info:
        await TcpKVConnector().fetch(
            endpoint=f"127.0.0.1:{port}",
            request_id="r",
            first_block=0,
            layout=LAYOUT,
            on_block=lambda i, d: None,
            timeout_seconds=timeout_seconds,
        )
    return info.value


def _layout_frame(num_blocks: int) -> bytes:
    return framing.encode_json(
        FrameType.LAYOUT,
        {
            "num_blocks": num_blocks,
            "num_tokens": num_blocks * 4,
            "first_block": 0,
            "block_nbytes": LAYOUT.block_nbytes,
        },
    )


async def test_corrupt_block_is_detected_by_crc() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(_layout_frame(1))
        payload = framing.BLOCK_INDEX.pack(0) + os.urandom(LAYOUT.block_nbytes)
        header = framing.encode_header(frame_type=FrameType.BLOCK, payload_len=len(payload), crc=0xDEADBEEF)
        writer.write(header + payload)
        await writer.drain()
        await reader.read()  # keep the connection open until the client, having detected it, hangs up
        writer.close()

    server, port = await _fake_prefill(handler)
    async with server:
        error = await _fetch_from(port)
    assert error.code == "corrupt" and "CRC" in error.message


async def test_truncated_block_is_detected() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(_layout_frame(2))
        payload = framing.BLOCK_INDEX.pack(0) + os.urandom(LAYOUT.block_nbytes)
        header = framing.encode_header(frame_type=FrameType.BLOCK, payload_len=len(payload), crc=0)
        writer.write(header + payload[: len(payload) // 2])
        await writer.drain()
        writer.close()

    server, port = await _fake_prefill(handler)
    async with server:
        error = await _fetch_from(port)
    assert error.code == "truncated"


async def test_silent_peer_times_out_instead_of_hanging() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # silent: never answers; returns once the client gives up and hangs up
        writer.close()

    server, port = await _fake_prefill(handler)
    async with server:
        started = asyncio.get_running_loop().time()
        error = await _fetch_from(port, timeout_seconds=0.3)
        elapsed = asyncio.get_running_loop().time() - started
        server.close()
    assert error.code == "timeout" and elapsed < 2.0


async def test_nothing_listening_is_connect_failed() -> None:
    server, port = await _fake_prefill(lambda r, w: None)
    server.close()
    await server.wait_closed()
    error = await _fetch_from(port)
    assert error.code == "connect_failed"


async def test_oversized_frame_is_rejected_before_reading_it() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(_layout_frame(1))
        writer.write(framing.encode_header(frame_type=FrameType.BLOCK, payload_len=1 << 30, crc=0))
        await writer.drain()
        await reader.read()  # keep the connection open until the client, having detected it, hangs up
        writer.close()

    server, port = await _fake_prefill(handler)
    async with server:
        error = await _fetch_from(port)
    assert error.code == "corrupt" and "exceeds the limit" in error.message


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"num_blocks": None}, "protocol"),  # before: KeyError/TypeError escaped fetch (a 500)
        ({"num_tokens": "4"}, "protocol"),
        ({"num_blocks": 9}, "protocol"),  # 9 blocks cannot hold 4 tokens
        ({"first_block": 1}, "protocol"),  # not the block asked for
        ({"num_blocks": 2, "num_tokens": 8}, "prompt_mismatch"),  # another prompt's KV
        ({"block_nbytes": 7}, "layout_mismatch"),
    ],
)
async def test_a_layout_that_does_not_describe_the_pull_is_refused_before_any_block(
    changes: dict[str, object], code: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        header = {"num_blocks": 1, "num_tokens": 4, "first_block": 0, "block_nbytes": LAYOUT.block_nbytes}
        header.update(changes)  # type: ignore[arg-type]
        header = {k: v for k, v in header.items() if v is not None}
        writer.write(framing.encode_json(FrameType.LAYOUT, header))
        framing.write_block(writer, index=0, data=os.urandom(LAYOUT.block_nbytes))
        writer.write(framing.encode_json(FrameType.DONE, {"num_bytes": 0}))
        await writer.drain()
        await reader.read()
        writer.close()

    server, port = await _fake_prefill(handler)
    received: list[int] = []
    async with server:
        with pytest.raises(TransferError) as info:
            await TcpKVConnector().fetch(
                endpoint=f"127.0.0.1:{port}",
                request_id="r",
                first_block=0,
                layout=LAYOUT,
                on_block=lambda i, _d: received.append(i),
                timeout_seconds=1.0,
                expected_num_tokens=4,
            )
    assert info.value.code == code and received == []
