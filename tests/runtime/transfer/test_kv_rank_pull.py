"""Rank-to-rank KV handoff between pods of different parallel layouts, as real processes (gloo
on the CPU): a prefill pod at TP 2 feeds a decode pod at TP 1, TP 1 feeds TP 2, TP 2 feeds
TP 2, and a two-stage pipeline feeds TP 1. The answers equal the aggregated single-process
engine's, every decode rank connects only to the prefill ranks that hold its (layer, KV head)
slice and receives exactly its share of each block (never the whole model), a rank endpoint
refuses a puller without the pool's key, and a prefill rank that is gone makes the decode pod
compute the prompt itself (same answer)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_contract.handoff import HandoffParams
from splitserve_runtime.disagg.engine import HandoffEngine
from splitserve_runtime.disagg.layout import KVRanks
from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.parallel.runner import ParallelRunner
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.model.tiny import write_tiny_model
from splitserve_runtime.transfer import (
    HandoffAuth,
    HandoffKey,
    KVSlice,
    TcpKVConnector,
    TransferError,
)
from splitserve_runtime.transfer.framing import BLOCK_HEADER_SIZE, BLOCK_INDEX

BASE = ServeArgs(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_model_len=128,
    max_num_batched_tokens=128,
    prefix_caching=False,
    chunked_prefill=False,
    kv_port=0,
    compat_hash="rank-pull",
)
KEY = HandoffKey(b"rank-pull-test-key-0123456789abcdef")
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


@dataclasses.dataclass(frozen=True)
class Pod:
    handoff: HandoffEngine
    engine: AsyncEngine

    def slices(self) -> list[KVSlice]:
        """Each rank's slice of the blocks, in rank order."""
        runner = self.engine.engine.runner
        if isinstance(runner, ParallelRunner):
            return runner.rank_slices()
        return [KVSlice.whole(self.handoff.layout)]


async def _pod(model_dir: Path, role: str, overrides: dict[str, Any], *, key: HandoffKey | None) -> Pod:
    args = dataclasses.replace(BASE, model=str(model_dir), role=role, **overrides)
    engine = AsyncEngine.from_args(args)
    handoff = HandoffEngine(
        engine=engine,
        role=role,
        compat_hash=args.compat_hash,
        kv_host="127.0.0.1",
        kv_port=0,
        kv_endpoint="",
        kv_ttl_seconds=30,
        fetch_timeout_seconds=5.0,
        auth=HandoffAuth(key=key),
    )
    await handoff.start()
    handoff.kv_endpoint = f"127.0.0.1:{handoff.kv_server_port}"
    return Pod(handoff=handoff, engine=engine)


@contextlib.asynccontextmanager
async def _pods(
    model_dir: Path, prefill: dict[str, Any], decode: dict[str, Any], *, key: HandoffKey | None = KEY
) -> AsyncIterator[tuple[Pod, Pod]]:
    if key is not None:  # the worker ranks read the pool's key from a file, as in a pod
        path = model_dir.parent / "handoff.key"
        path.write_bytes(b"rank-pull-test-key-0123456789abcdef")
        prefill = {**prefill, "handoff_key_file": str(path)}
        decode = {**decode, "handoff_key_file": str(path)}
    pods = [await _pod(model_dir, "prefill", prefill, key=key), await _pod(model_dir, "decode", decode, key=key)]
    try:
        yield pods[0], pods[1]
    finally:
        for pod in pods:
            await pod.handoff.shutdown()


async def _export(prefill: HandoffEngine, prompt: list[int]) -> dict[str, Any]:
    exported: list[HandoffParams] = []
    async for _ in prefill.generate_for_export(
        request_id="r",
        prompt_token_ids=prompt,
        params=dataclasses.replace(GREEDY, max_tokens=1),
        on_export=exported.append,
    ):
        pass
    assert len(exported) == 1
    return exported[0].to_json()


async def _decode(decode: HandoffEngine, params: dict[str, Any], prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in decode.generate_from_remote(
        request_id="d",
        prompt_token_ids=prompt,
        params=GREEDY,
        source=decode.accept_remote(params, prompt_token_ids=prompt),
    ):
        tokens.extend(out.new_token_ids)
    return tokens


def _ranks(raw: dict[str, Any]) -> KVRanks | None:
    """Parse as a decode pod does: the contract's schema, then this runtime's layout."""
    params = HandoffParams.from_json(raw)
    return None if params.kv_layout is None else KVRanks.from_json(dict(params.kv_layout))


def test_handoff_parameters_with_a_bad_layout_are_refused_naming_it() -> None:
    base = {"remote_endpoint": "127.0.0.1:1", "remote_request_id": "r", "num_prompt_tokens": 3, "first_token_id": 1}
    rank = {"endpoint": "127.0.0.1:2", "layers": [0, 2], "heads": [0, 1]}
    layout = {"tp": 2, "pp": 1, "ranks": [rank, rank]}
    good = HandoffParams.from_json({**base, "kv_layout": layout})
    assert good.to_json()["kv_layout"]["ranks"][1] == rank  # round trip: the signature covers it
    ranks = _ranks({**base, "kv_layout": layout})
    assert ranks is not None and ranks.to_json() == layout
    bad: tuple[tuple[object, str], ...] = (
        ([], "must be an object"),
        ({"tp": 0, "pp": 1, "ranks": []}, "tp and pp >= 1"),
        ({"tp": True, "pp": 1, "ranks": [rank]}, "tp and pp >= 1"),
        ({"tp": 2, "pp": 1, "ranks": [rank]}, "the 2 x 1 ranks"),
        ({"tp": 1, "pp": 1, "ranks": [{"layers": [0, 2], "heads": [0, 1]}]}, "endpoint"),
        ({"tp": 1, "pp": 1, "ranks": [{"endpoint": "h:1", "layers": [0], "heads": [0, 1]}]}, "layers"),
    )
    for wrong, why in bad:
        with pytest.raises(ValueError, match=why):
            _ranks({**base, "kv_layout": wrong})


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[list[int], list[int]]:
    return _reference(tiny_llama_dir)


def _reference(model_dir: Path) -> tuple[list[int], list[int]]:
    """(prompt, the aggregated single-process engine's greedy tokens)."""
    engine = LLMEngine.from_args(dataclasses.replace(BASE, model=str(model_dir)))
    try:
        tokenizer: Any = engine.tokenizer
        prompt: list[int] = tokenizer.encode(PROMPT_TEXT)
        engine.add_request(request_id="ref", prompt_token_ids=prompt, params=GREEDY)
        tokens = [t for _ in range(100) if engine.has_unfinished() for out in engine.step() for t in out.new_token_ids]
        return prompt, tokens
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout"),
    [(TP2, {}), ({}, TP2), (TP2, TP2), (PP2, {})],
    ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2", "pp2-to-tp1"],
)
def test_each_decode_rank_pulls_its_share_from_the_ranks_holding_it(
    tiny_llama_dir: Path,
    reference: tuple[list[int], list[int]],
    prefill_layout: dict[str, int],
    decode_layout: dict[str, int],
) -> None:
    prompt, want = reference

    async def run() -> None:
        async with _pods(tiny_llama_dir, prefill_layout, decode_layout) as (prefill, decode):
            served: list[tuple[int, float, bool]] = []  # prefill rank 0's KV endpoint's transfers
            prefill.handoff.set_observer(lambda num_bytes, seconds, ok: served.append((num_bytes, seconds, ok)))
            params = await _export(prefill.handoff, prompt)
            assert ("kv_layout" in params) == bool(prefill_layout)  # single-endpoint shape at TP 1
            assert await _decode(decode.handoff, params, prompt) == want
            layout = decode.handoff.layout
            held = prefill.slices()
            num_blocks = -(-len(prompt) // layout.block_size)
            reports = list(decode.handoff.rank_pulls)
            assert [r.rank for r in reports] == list(range(len(decode.slices())))
            for report, mine in zip(reports, decode.slices(), strict=True):
                holders = [i for i, part in enumerate(held) if part.intersect(mine) is not None]
                assert report.ok and report.sources == tuple(holders)
                # its own slice of every block (plus each piece's 4-byte block index), not the whole model
                assert report.num_bytes == num_blocks * (mine.block_nbytes(layout) + BLOCK_INDEX.size * len(holders))
            # prefill rank 0 served each decode rank that needs part of its slice, that part only
            wanted = [part for mine in decode.slices() if (part := held[0].intersect(mine)) is not None]
            assert sorted(b for b, _, ok in served if ok and b) == sorted(
                num_blocks * (BLOCK_HEADER_SIZE + part.block_nbytes(layout)) for part in wanted
            )
            assert prefill.handoff.num_unclaimed_exports == 0  # released on the prefill pod's main endpoint

    asyncio.run(run())


def test_a_rank_endpoint_refuses_a_puller_without_the_key(
    tiny_llama_dir: Path, reference: tuple[list[int], list[int]]
) -> None:
    prompt, _ = reference

    async def run() -> None:
        async with _pods(tiny_llama_dir, TP2, {}) as (prefill, decode):
            params = await _export(prefill.handoff, prompt)
            rank1 = params["kv_layout"]["ranks"][1]
            stranger = TcpKVConnector(auth=HandoffAuth(key=HandoffKey(b"another-pool-key-0123456789abcdef")))
            with pytest.raises(TransferError) as refused:
                await stranger.fetch(
                    endpoint=rank1["endpoint"],
                    request_id="r",
                    first_block=0,
                    layout=decode.handoff.layout,
                    on_block=lambda _i, _d: None,
                    timeout_seconds=5.0,
                    slice=KVSlice.from_json(rank1),
                    release=False,
                )
            assert refused.value.code == "unauthorized"
            assert await _decode(decode.handoff, params, prompt) == reference[1]  # still served
            assert all(r.ok for r in decode.handoff.rank_pulls)

    asyncio.run(run())


def test_a_prefill_rank_that_is_gone_falls_back_to_local_prefill(
    tiny_llama_dir: Path, reference: tuple[list[int], list[int]]
) -> None:
    prompt, want = reference

    async def run() -> None:
        async with _pods(tiny_llama_dir, TP2, TP2, key=None) as (prefill, decode):
            params = await _export(prefill.handoff, prompt)
            # unsigned (no key: loopback only), so the test can say rank 1's pod is gone: nothing listens there
            params["kv_layout"]["ranks"][1]["endpoint"] = "127.0.0.1:1"
            assert await _decode(decode.handoff, params, prompt) == want  # computed on the decode pod
            reports = list(decode.handoff.rank_pulls)
            assert [(r.rank, r.ok) for r in reports] == [(0, True), (1, False)]  # rank 0 pulled from rank 0 only
            assert reports[1].code == "connect_failed"
            for _ in range(100):  # the failed pull still released the export on prefill rank 0
                if not prefill.handoff.num_unclaimed_exports:
                    break
                await asyncio.sleep(0.02)
            assert prefill.handoff.num_unclaimed_exports == 0
            assert decode.engine.engine.block_manager.usage_ratio == 0.0  # the request finished, nothing leaked

    asyncio.run(run())


def test_a_replicated_kv_head_is_pulled_once_from_one_prefill_rank(tmp_path: Path) -> None:
    """One KV head at TP 2: both prefill ranks hold it, both decode ranks need it; each decode
    rank pulls it once, from one prefill rank (decode rank r from replica r: spread)."""
    model_dir = write_tiny_model(out_dir=tmp_path / "model", seed=3, num_heads=4, num_kv_heads=1)
    prompt, want = _reference(model_dir)

    async def run() -> None:
        async with _pods(model_dir, TP2, TP2) as (prefill, decode):
            assert prefill.slices() == [KVSlice(0, 2, 0, 1)] * 2
            params = await _export(prefill.handoff, prompt)
            assert await _decode(decode.handoff, params, prompt) == want
            reports = list(decode.handoff.rank_pulls)
            assert [(r.rank, r.ok, r.sources) for r in reports] == [(0, True, (0,)), (1, True, (1,))]

    asyncio.run(run())
