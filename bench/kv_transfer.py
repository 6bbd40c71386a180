"""KV transfer throughput on loopback: our TCP connector vs a raw socket copy of the same bytes.

Two shapes in one run: 64 blocks of 2 MiB (a Llama-3.1-8B block: 32 layers x K,V x 16 tokens x
8 KV heads x 128 dims x bf16) and 1024 blocks of 128 KiB (many small frames, where per-frame
costs show), 128 MiB each. For each:

- ``destination``: the connector receiving every block straight into its slot of the decode
  side's cache (a :class:`~splitserve_runtime.transfer.BlockDestination`);
- ``copy``: a plain ``on_block`` sink copying each block into its slot (one copy more: what
  the engine's ``write_block`` sink does);
- ``raw``: the same bytes with no protocol at all: the sender hands each block to
  ``sock_sendall``, the receiver ``recv_into``s it straight into its slot;
- ``half``: one decode rank's pull at tensor parallelism 2 from a TP 1 prefill pod: half the
  KV heads of every block (a :class:`~splitserve_runtime.transfer.KVSlice`, which the server
  cuts out of each block: one copy more there), straight into a destination. Its GB/s count
  the bytes it moves (half of the others');
- ``no-crc``: the ``destination`` leg with the CRC-32 replaced by a constant on both sides
  (a second prefill process, and the decode side for that leg only): not a mode of the
  product, a bound that shows what the integrity check costs, so that the gap between
  ``destination`` and ``raw`` splits into the checksum and everything else (framing,
  handshake, Python's per-frame work).

Every leg runs on one event loop, the prefill side in a separate process (as the pods are),
so the ratio shows what framing, CRCs, the handshake and Python's per-frame work cost; the
machine's noise moves all legs alike, so compare ratios of one run. Figures are GB/s (10^9
bytes/s) of block payload and the decode and prefill sides' CPU milliseconds per pull, each
with its ratio to the raw leg (``x raw``; for CPU, lower is cheaper), medians of ``--repeat``
runs. The prefill side's CPU is read from Linux's ``/proc/<pid>/task/*/schedstat`` (``-``
elsewhere): on a machine with two cores both sides are busy at once, so the side with more
work per byte bounds the transfer.

    python bench/kv_transfer.py [--repeat 5] [--shape 64x2097152 --shape 1024x131072]

``--legs copy,raw`` runs only those legs (e.g. against an older connector without
destinations, for before/after figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve_runtime.transfer import (
    ExportedKV,
    KVExportRegistry,
    KVLayout,
    KVSlice,
    TcpKVConnector,
    TcpKVServer,
    framing,
)

DEFAULT_SHAPES = ("64x2097152", "1024x131072")
LEGS = ("destination", "copy", "raw", "half", "no-crc")


@dataclass(frozen=True)
class Shape:
    num_blocks: int
    block_nbytes: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        blocks, sep, nbytes = text.partition("x")
        if not sep or not blocks.isdigit() or not nbytes.isdigit() or int(blocks) < 1:
            raise argparse.ArgumentTypeError(f"a shape is BLOCKSxBYTES, e.g. 64x2097152, not {text!r}")
        shape = cls(num_blocks=int(blocks), block_nbytes=int(nbytes))
        shape.layout()  # an expressible block size, or a clear error now
        return shape

    def layout(self) -> KVLayout:
        """A KV layout whose blocks have exactly ``block_nbytes`` bytes (bf16, 8 heads of 128)."""
        per_token_layer = 2 * 8 * 128 * 2  # K and V, 8 KV heads x 128 dims, bf16
        if self.block_nbytes % (per_token_layer * 16):
            raise argparse.ArgumentTypeError(f"block bytes must be a multiple of {per_token_layer * 16}")
        num_layers = self.block_nbytes // (per_token_layer * 16)
        return KVLayout(
            num_layers=num_layers,
            block_size=16,
            num_kv_heads=8,
            head_dim=128,
            dtype="bfloat16",
            dtype_bytes=2,
            compat_hash="bench",
        )

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def half(self) -> KVSlice:
        """Half the KV heads of every layer: a TP 2 decode rank's share."""
        layout = self.layout()
        return KVSlice(0, layout.num_layers, 0, layout.num_kv_heads // 2)

    def __str__(self) -> str:
        size = (
            f"{self.block_nbytes >> 20} MiB" if self.block_nbytes % (1 << 20) == 0 else f"{self.block_nbytes >> 10} KiB"
        )
        return f"{self.num_blocks} x {size}"


# --------------------------------------------------------------------------- prefill process
def _constant_crc(data: object, value: int = 0) -> int:
    """The ``no-crc`` leg's checksum: every frame's CRC is 0 (never a mode of the product)."""
    return 0


@contextlib.contextmanager
def _without_crc() -> Iterator[None]:
    """The connector's CRC-32 replaced by a constant while the block runs."""
    real = framing._crc32
    framing._crc32 = _constant_crc
    try:
        yield
    finally:
        framing._crc32 = real


async def _serve(shape: Shape, requests: int, pipe: multiprocessing.connection.Connection) -> None:
    """Export ``requests`` copies of one request (one per timed pull) and a raw server."""
    layout = shape.layout()
    blocks = [os.urandom(shape.block_nbytes) for _ in range(shape.num_blocks)]
    registry = KVExportRegistry(ttl_seconds=600)
    for number in range(requests):
        registry.add(
            ExportedKV(
                request_id=f"bench-{number}",
                num_tokens=shape.num_blocks * layout.block_size,
                num_blocks=shape.num_blocks,
                read_block=lambda i: memoryview(blocks[i]),
                release=lambda: None,
            )
        )
    server = TcpKVServer(registry=registry, layout=layout, host="127.0.0.1", port=0)
    await server.start()
    loop = asyncio.get_running_loop()
    raw = socket.create_server(("127.0.0.1", 0))
    raw.setblocking(False)

    async def raw_forever() -> None:
        while True:
            connection, _ = await loop.sock_accept(raw)
            with connection:
                connection.setblocking(False)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_recv(connection, 1)
                for block in blocks:
                    await loop.sock_sendall(connection, block)
                await loop.sock_recv(connection, 1)  # until the receiver has everything

    raw_task = asyncio.create_task(raw_forever())
    pipe.send((server.port, raw.getsockname()[1]))
    await loop.run_in_executor(None, pipe.recv)  # the parent says stop
    raw_task.cancel()
    await server.stop()
    raw.close()


def _prefill_process(
    shape: Shape, requests: int, pipe: multiprocessing.connection.Connection, crc: bool = True
) -> None:
    with contextlib.nullcontext() if crc else _without_crc():
        asyncio.run(_serve(shape, requests, pipe))


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by every thread of process ``pid`` (Linux), else None."""
    try:
        return (
            sum(
                int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
                for task in os.listdir(f"/proc/{pid}/task")
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- decode side
class Cache:
    """The decode side's cache: one slot per block of the pull, allocated and touched once per
    shape, so that every leg writes into the same warm memory."""

    def __init__(self, shape: Shape) -> None:
        self.block_nbytes = shape.block_nbytes
        self.memory = memoryview(bytearray(b"\x01") * shape.num_bytes)

    def block(self, index: int) -> memoryview:
        return self.memory[index * self.block_nbytes : (index + 1) * self.block_nbytes]


class Destination:
    """A :class:`~splitserve_runtime.transfer.BlockDestination`: blocks land in their slot."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.count = 0

    def buffers(self, index: int) -> Sequence[memoryview]:
        return [self.cache.block(index)]

    def received(self, index: int) -> None:
        self.count += 1


class HalfDestination(Destination):
    """Half a block per slot (the ``half`` leg's slices)."""

    def buffers(self, index: int) -> Sequence[memoryview]:
        return [self.cache.block(index)[: self.cache.block_nbytes // 2]]


async def _half(shape: Shape, cache: Cache, *, port: int, request_id: str) -> float:
    destination = HalfDestination(cache)
    started = time.perf_counter()
    await TcpKVConnector().fetch(
        endpoint=f"127.0.0.1:{port}",
        request_id=request_id,
        first_block=0,
        layout=shape.layout(),
        on_block=destination,
        timeout_seconds=60,
        slice=shape.half(),
    )
    elapsed = time.perf_counter() - started
    assert destination.count == shape.num_blocks
    return elapsed


async def _ours(shape: Shape, cache: Cache, *, port: int, request_id: str, copy: bool) -> float:
    destination = Destination(cache)

    def on_block(index: int, data: memoryview) -> None:
        cache.block(index)[:] = data  # the sink's copy into the decode pod's cache
        destination.count += 1

    started = time.perf_counter()
    await TcpKVConnector().fetch(
        endpoint=f"127.0.0.1:{port}",
        request_id=request_id,
        first_block=0,
        layout=shape.layout(),
        on_block=on_block if copy else destination,
        timeout_seconds=60,
    )
    elapsed = time.perf_counter() - started
    assert destination.count == shape.num_blocks
    return elapsed


async def _raw(shape: Shape, cache: Cache, *, port: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_sendall(sock, b"x")
        for index in range(shape.num_blocks):
            destination = cache.block(index)
            filled = 0
            while filled < shape.block_nbytes:
                count = await loop.sock_recv_into(sock, destination[filled:])
                if not count:
                    raise ConnectionError("the raw sender closed early")
                filled += count
        elapsed = time.perf_counter() - started
        await loop.sock_sendall(sock, b"x")
    return elapsed


async def _leg(leg: str, shape: Shape, cache: Cache, *, ports: tuple[int, int], request_id: str) -> float:
    if leg == "raw":
        return await _raw(shape, cache, port=ports[1])
    if leg == "half":
        return await _half(shape, cache, port=ports[0], request_id=request_id)
    if leg == "no-crc":
        with _without_crc():
            return await _ours(shape, cache, port=ports[0], request_id=request_id, copy=False)
    return await _ours(shape, cache, port=ports[0], request_id=request_id, copy=leg == "copy")


@dataclass(frozen=True)
class Figures:
    """One leg on one shape: medians over the timed runs."""

    gb_per_s: float
    decode_cpu_seconds: float
    """CPU time of the decode side (this process) per pull: less noisy than wall time on a
    shared machine."""
    prefill_cpu_seconds: float | None
    """CPU time of the prefill process per pull (None where it cannot be read)."""


@dataclass
class _Prefill:
    """One prefill process and its pipe (the ``no-crc`` leg has its own)."""

    process: multiprocessing.process.BaseProcess
    pipe: multiprocessing.connection.Connection

    @classmethod
    def start(cls, shape: Shape, requests: int, *, crc: bool) -> _Prefill:
        parent, child = multiprocessing.Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=_prefill_process, args=(shape, requests, child, crc), daemon=True
        )
        process.start()
        return cls(process=process, pipe=parent)

    def stop(self) -> None:
        self.pipe.send("stop")
        self.process.join(30)


async def _measure(shape: Shape, *, repeat: int, legs: Sequence[str]) -> dict[str, Figures]:
    """Each leg's figures (median of ``repeat``), the legs interleaved so noise hits them alike."""
    requests = len(legs) * (repeat + 1)
    prefill = {True: _Prefill.start(shape, requests, crc=True)}
    if "no-crc" in legs:
        prefill[False] = _Prefill.start(shape, requests, crc=False)
    try:
        loop = asyncio.get_running_loop()
        ports = {crc: await loop.run_in_executor(None, side.pipe.recv) for crc, side in prefill.items()}
        times: dict[str, list[float]] = {leg: [] for leg in legs}
        cpu: dict[str, list[float]] = {leg: [] for leg in legs}
        prefill_cpu: dict[str, list[float]] = {leg: [] for leg in legs}
        cache = Cache(shape)
        pulls = 0
        for run in range(repeat + 1):  # the first round warms up and is not counted
            for leg in legs:
                crc = leg != "no-crc"
                pid = prefill[crc].process.pid or 0
                cpu_started, prefill_started = time.process_time(), _cpu_seconds(pid)
                seconds = await _leg(leg, shape, cache, ports=ports[crc], request_id=f"bench-{pulls}")
                pulls += 1
                prefill_ended = _cpu_seconds(pid)
                if run:
                    times[leg].append(seconds)
                    cpu[leg].append(time.process_time() - cpu_started)
                    if prefill_started is not None and prefill_ended is not None:
                        prefill_cpu[leg].append(prefill_ended - prefill_started)
        return {
            leg: Figures(
                gb_per_s=shape.num_bytes / (2 if leg == "half" else 1) / statistics.median(times[leg]) / 1e9,
                decode_cpu_seconds=statistics.median(cpu[leg]),
                prefill_cpu_seconds=statistics.median(prefill_cpu[leg]) if prefill_cpu[leg] else None,
            )
            for leg in legs
        }
    finally:
        for side in prefill.values():
            side.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)}")
    parser.add_argument(
        "--shape",
        type=Shape.parse,
        action="append",
        help=f"BLOCKSxBYTES, repeatable (default: {' and '.join(DEFAULT_SHAPES)})",
    )
    args = parser.parse_args()
    shapes: list[Shape] = args.shape or [Shape.parse(text) for text in DEFAULT_SHAPES]
    legs = [leg for leg in LEGS if leg in args.legs.split(",")]
    if not legs or set(args.legs.split(",")) - set(LEGS):
        parser.error(f"--legs takes a comma-separated choice of {', '.join(LEGS)}")
    crc = getattr(framing, "CRC32_IMPLEMENTATION", "zlib")
    print(f"KV transfer on loopback, CRC-32 by {crc}, median of {args.repeat} (GB/s = 1e9 bytes/s)")
    print(
        f"{'shape':<16}{'leg':<13}{'GB/s':>7}{'x raw':>7}{'decode CPU ms':>15}{'x raw':>7}"
        f"{'prefill CPU ms':>16}{'x raw':>7}"
    )
    for shape in shapes:
        figures = await _measure(shape, repeat=args.repeat, legs=legs)
        raw = figures.get("raw")
        for number, leg in enumerate(legs):
            leg_figures = figures[leg]
            prefill_cpu = leg_figures.prefill_cpu_seconds
            print(
                f"{str(shape) if number == 0 else '':<16}{leg:<13}{leg_figures.gb_per_s:>7.2f}"
                f"{_ratio(leg_figures.gb_per_s, raw.gb_per_s if raw else None)}"
                f"{leg_figures.decode_cpu_seconds * 1e3:>15.1f}"
                f"{_ratio(leg_figures.decode_cpu_seconds, raw.decode_cpu_seconds if raw else None)}"
                f"{'-' if prefill_cpu is None else f'{prefill_cpu * 1e3:.1f}':>16}"
                f"{_ratio(prefill_cpu, raw.prefill_cpu_seconds if raw else None)}"
            )


def _ratio(value: float | None, base: float | None) -> str:
    """``value / base`` in the table's 7 columns, ``-`` where either is missing."""
    return f"{value / base:>7.2f}" if value is not None and base else f"{'-':>7}"


if __name__ == "__main__":
    asyncio.run(main())
