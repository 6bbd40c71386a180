"""KV slices: which prefill rank a decode rank pulls each (layer, KV head) from, and a KV server
that serves only the slice of its blocks it holds (over real loopback sockets)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from splitserve_runtime.transfer import (
    ExportedKV,
    KVExportRegistry,
    KVLayout,
    KVSlice,
    RankSource,
    TcpKVConnector,
    TcpKVServer,
    TransferError,
    plan_pulls,
)
from splitserve_runtime.transfer.slices import extract
from splitserve_runtime.transfer.wire import byte_view

LAYOUT = KVLayout(
    num_layers=4, block_size=2, num_kv_heads=4, head_dim=3, dtype="float32", dtype_bytes=4, compat_hash="abc"
)
WHOLE = KVSlice.whole(LAYOUT)


def _ranks(*slices: tuple[int, int, int, int]) -> list[RankSource]:
    return [RankSource(endpoint=f"127.0.0.1:{9000 + i}", slice=KVSlice(*s)) for i, s in enumerate(slices)]


def test_a_whole_cache_pulls_each_tensor_parallel_rank_s_heads() -> None:
    assert plan_pulls(WHOLE, _ranks((0, 4, 0, 2), (0, 4, 2, 4)), layout=LAYOUT) == [
        (0, KVSlice(0, 4, 0, 2)),
        (1, KVSlice(0, 4, 2, 4)),
    ]


def test_a_decode_rank_pulls_only_what_it_owns() -> None:
    # decode rank 1 of TP 2 (heads 2..3) from a TP 4 prefill pod: ranks 2 and 3 only
    tp4 = _ranks((0, 4, 0, 1), (0, 4, 1, 2), (0, 4, 2, 3), (0, 4, 3, 4))
    assert plan_pulls(KVSlice(0, 4, 2, 4), tp4, layout=LAYOUT) == [(2, KVSlice(0, 4, 2, 3)), (3, KVSlice(0, 4, 3, 4))]
    # from one endpoint holding everything: just its heads
    assert plan_pulls(KVSlice(0, 4, 2, 4), _ranks((0, 4, 0, 4)), layout=LAYOUT) == [(0, KVSlice(0, 4, 2, 4))]
    # a two-stage pipeline: each stage's layers from that stage
    pp2 = _ranks((0, 2, 0, 4), (2, 4, 0, 4))
    assert plan_pulls(KVSlice(0, 4, 0, 2), pp2, layout=LAYOUT) == [(0, KVSlice(0, 2, 0, 2)), (1, KVSlice(2, 4, 0, 2))]


def test_a_replicated_kv_head_is_pulled_once_from_one_replica_spread_over_pullers() -> None:
    two_heads = KVLayout(**{**LAYOUT.to_json(), "num_kv_heads": 2})
    replicated = _ranks((0, 4, 0, 1), (0, 4, 0, 1), (0, 4, 1, 2), (0, 4, 1, 2))  # TP 4 over 2 KV heads
    whole = KVSlice.whole(two_heads)
    assert plan_pulls(whole, replicated, layout=two_heads) == [(0, KVSlice(0, 4, 0, 1)), (2, KVSlice(0, 4, 1, 2))]
    assert plan_pulls(whole, replicated, layout=two_heads, spread=1) == [
        (1, KVSlice(0, 4, 0, 1)),
        (3, KVSlice(0, 4, 1, 2)),
    ]
    assert plan_pulls(whole, replicated, layout=two_heads, spread=2) == plan_pulls(whole, replicated, layout=two_heads)


def test_a_layout_that_does_not_cover_or_fit_is_refused() -> None:
    with pytest.raises(TransferError, match="do not hold all") as missing:
        plan_pulls(WHOLE, _ranks((0, 4, 0, 2)), layout=LAYOUT)
    assert missing.value.code == "layout_mismatch"
    with pytest.raises(TransferError, match="outside the KV layout"):
        plan_pulls(WHOLE, _ranks((0, 4, 0, 2), (0, 4, 2, 5)), layout=LAYOUT)
    with pytest.raises(TransferError, match="overlaps"):
        plan_pulls(WHOLE, _ranks((0, 4, 0, 3), (0, 4, 2, 4)), layout=LAYOUT)


def test_slices_round_trip_json_and_refuse_garbage() -> None:
    part = KVSlice(1, 3, 0, 2)
    assert KVSlice.from_json(part.to_json()) == part
    assert RankSource.from_json({"endpoint": "h:1", **part.to_json()}) == RankSource("h:1", part)
    bad: object
    for bad in ({"layers": [0, 1]}, {"layers": [0, "1"], "heads": [0, 1]}, {"layers": [True, 1], "heads": [0, 1]}, []):
        with pytest.raises(TransferError):
            KVSlice.from_json(bad)
    with pytest.raises(ValueError, match="endpoint"):
        RankSource.from_json(part.to_json())


def _block(held: KVSlice, seed: int) -> np.ndarray:
    shape = (held.num_layers, 2, LAYOUT.block_size, held.num_heads, LAYOUT.head_dim * LAYOUT.dtype_bytes)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_extract_takes_the_sub_rectangle_in_wire_order() -> None:
    held = KVSlice(2, 4, 1, 4)
    block = _block(held, 0)
    wanted = KVSlice(3, 4, 2, 4)
    got = extract(memoryview(block.tobytes()), layout=LAYOUT, held=held, wanted=wanted)
    assert bytes(got) == block[1:2, :, :, 1:3].tobytes()
    assert len(got) == wanted.block_nbytes(LAYOUT)


async def test_a_server_serves_slices_of_what_it_holds_and_keeps_them_for_other_pullers() -> None:
    held = KVSlice(0, 4, 2, 4)  # tensor-parallel rank 1 of 2
    blocks = [_block(held, seed) for seed in range(3)]
    released: list[str] = []
    registry = KVExportRegistry(ttl_seconds=30)
    registry.add(
        ExportedKV(
            request_id="r",
            num_tokens=5,
            num_blocks=3,
            read_block=lambda i: byte_view(blocks[i]),
            release=lambda: released.append("r"),
        )
    )
    server = TcpKVServer(registry=registry, layout=LAYOUT, host="127.0.0.1", port=0, holds=held)
    await server.start()
    endpoint = f"127.0.0.1:{server.port}"
    connector = TcpKVConnector()
    try:
        wanted = KVSlice(0, 4, 3, 4)
        received: dict[int, bytes] = {}
        result = await connector.fetch(
            endpoint=endpoint,
            request_id="r",
            first_block=1,
            layout=LAYOUT,
            on_block=lambda i, data: received.__setitem__(i, bytes(data)),
            timeout_seconds=2.0,
            slice=wanted,
            release=False,
        )
        assert received == {i: blocks[i][:, :, :, 1:2].tobytes() for i in (1, 2)}
        assert result.num_bytes == 2 * (4 + wanted.block_nbytes(LAYOUT))
        for outside in (KVSlice(0, 4, 1, 3), None):  # heads it lacks; the whole block
            with pytest.raises(TransferError, match="holds layers 0..3, KV heads 2..3") as refused:
                await connector.fetch(
                    endpoint=endpoint,
                    request_id="r",
                    first_block=0,
                    layout=LAYOUT,
                    on_block=lambda _i, _d: None,
                    timeout_seconds=2.0,
                    slice=outside,
                )
            assert refused.value.code == "layout_mismatch"
        await asyncio.sleep(0.05)
        assert released == [] and len(registry) == 1  # release=False: others still pull it
        # the driver's release: no blocks, whole layout
        await connector.fetch(
            endpoint=endpoint,
            request_id="r",
            first_block=3,
            layout=LAYOUT,
            on_block=lambda _i, _d: None,
            timeout_seconds=2.0,
        )
        for _ in range(100):
            if released:
                break
            await asyncio.sleep(0.01)
        assert released == ["r"] and len(registry) == 0
    finally:
        await server.stop()
