"""KV transfer throughput on loopback: our TCP connector vs a raw socket copy of the same bytes.

Both legs move the same payload (N blocks of an 8B-shaped KV layout, scaled down) over
127.0.0.1 in one run, so the ratio shows what framing, CRCs and per-block drains cost.

    python bench/kv_transfer.py [--blocks 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from splitserve_runtime.transfer import (
    ExportedKV,
    KVExportRegistry,
    KVLayout,
    TcpKVConnector,
    TcpKVServer,
)

# One block of Llama-3.1-8B: 32 layers x (K,V) x 16 tokens x 8 KV heads x 128 dims x bf16 = 2 MiB.
LAYOUT = KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16", dtype_bytes=2)


async def _ours(*, blocks: list[bytes]) -> float:
    registry = KVExportRegistry(ttl_seconds=60)
    registry.add(ExportedKV(
        request_id="bench", num_tokens=len(blocks) * LAYOUT.block_size, num_blocks=len(blocks),
        read_block=lambda i: memoryview(blocks[i]), release=lambda: None,
    ))
    server = TcpKVServer(registry=registry, layout=LAYOUT, host="127.0.0.1", port=0)
    await server.start()
    sink = bytearray(LAYOUT.block_nbytes)

    def on_block(_index: int, data: memoryview) -> None:
        sink[:] = data  # the copy into the decode pod's cache

    try:
        started = time.perf_counter()
        await TcpKVConnector().fetch(
            endpoint=f"127.0.0.1:{server.port}", request_id="bench", first_block=0,
            layout=LAYOUT, on_block=on_block, timeout_seconds=60,
        )
        return time.perf_counter() - started
    finally:
        await server.stop()


async def _raw(*, blocks: list[bytes]) -> float:
    total = sum(len(b) for b in blocks)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        for block in blocks:
            writer.write(block)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x")
        await writer.drain()
        sink = bytearray(LAYOUT.block_nbytes)
        remaining = total
        while remaining:
            chunk = await reader.readexactly(min(LAYOUT.block_nbytes, remaining))
            sink[: len(chunk)] = chunk
            remaining -= len(chunk)
        elapsed = time.perf_counter() - started
        writer.close()
        return elapsed
    finally:
        server.close()
        await server.wait_closed()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    blocks = [os.urandom(LAYOUT.block_nbytes) for _ in range(args.blocks)]
    num_bytes = LAYOUT.block_nbytes * args.blocks
    ours = [await _ours(blocks=blocks) for _ in range(args.repeat)]
    raw = [await _raw(blocks=blocks) for _ in range(args.repeat)]
    gb_ours = num_bytes / statistics.median(ours) / 1e9
    gb_raw = num_bytes / statistics.median(raw) / 1e9
    print(f"payload: {args.blocks} blocks x {LAYOUT.block_nbytes / 2**20:.1f} MiB = {num_bytes / 2**20:.0f} MiB, median of {args.repeat}")
    print(f"{'leg':<22}{'GB/s':>8}")
    print(f"{'splitserve TCP':<22}{gb_ours:>8.2f}")
    print(f"{'raw socket copy':<22}{gb_raw:>8.2f}")
    print(f"{'ratio ours/raw':<22}{gb_ours / gb_raw:>8.2f}")


if __name__ == "__main__":
    asyncio.run(main())
