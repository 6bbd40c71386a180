"""Property-based fuzzing of the KV transfer against hostile peers (issue 12: malformed KV
frames never corrupt the decode pod's cache, never crash it, never make it answer 5xx).

Five layers, each with real sockets where there is a peer:

1. the frame decoder the pods use (:meth:`~splitserve_runtime.transfer.wire.Channel.read_frame`,
   reading from a real socket) on arbitrary bytes and on mutated frames (bad magic, version,
   type, CRC, length; truncated; huge lengths): it returns only frames within the size limit
   whose CRC holds, and fails only with FrameError / PeerClosed; valid frames round-trip
   exactly;
2. the puller (:class:`~splitserve_runtime.transfer.TcpKVConnector`) against a hostile KV
   server that follows a generated script (a LAYOUT with a missing or wrong proof, wrong or
   ill-typed counts; BLOCK frames with wrong index, size, CRC, cut short; garbage, ERROR
   frames, huge lengths, an early DONE or hang-up): it raises only TransferError, hands the
   sink only the right blocks in order, and returns only for a complete, correct stream;
3. the prefill pod's KV server against hostile pullers (garbage, arbitrary FETCH bodies,
   with and without a valid token): without the token it sends an ERROR and nothing else, it
   never hits an unhandled exception, and it keeps the export for the real puller;
4. the decode engine itself (:class:`~splitserve_runtime.disagg.engine.HandoffEngine`, the
   tiny model on CPU) pulling from such a server: every request completes with exactly the
   tokens the aggregated engine produces (a poisoned block, in the reservation or the prefix
   cache, would change them), and no block stays reserved or held afterwards;
5. the handoff parameters themselves (:meth:`~splitserve_runtime.transfer.HandoffAuth.check_params`)
   with a key and without: genuine parameters with a field altered, dropped or retyped, and
   presented with their own prompt or another one (same length, a prefix, one token changed,
   any list). With a key only the untouched parameters with their own prompt pass; without
   one, nothing passes with another prompt (the prefix-cache poisoning defect: parameters of
   prompt A used for a prompt B of the same length).

The number of generated cases is fixed per test (``max_examples``; ``derandomize`` keeps
runs repeatable); ``SPLITSERVE_FUZZ_SCALE`` multiplies them for a longer run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import socket
import threading
import zlib
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve_contract.block_hash import prompt_digest
from splitserve_runtime.transfer import (
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
from splitserve_runtime.transfer.framing import HEADER, MAGIC, VERSION, Frame, FrameError, FrameType
from splitserve_runtime.transfer.wire import Channel, PeerClosed

T = TypeVar("T")
SCALE = float(os.environ.get("SPLITSERVE_FUZZ_SCALE", "1"))
KEY = HandoffKey(b"fuzz-key-fuzz-key-fuzz-key-0123")
STRANGER = HandoffKey(b"not-the-key-not-the-key-not-the")
LAYOUT = KVLayout(
    num_layers=1, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32", dtype_bytes=4, compat_hash="fuzz"
)  # 128-byte blocks
MAX_PAYLOAD = 1024
CASES: dict[str, int] = {}
"""Generated cases run per test (printed at the end of the module)."""
OUTCOMES: dict[str, int] = {}
"""How the decode engine's pulls ended: "pulled", or the transfer error code it fell back on."""
PULLER_OUTCOMES: dict[str, int] = {}


def _examples(count: int) -> int:
    return max(1, int(count * SCALE))


def _settings(count: int) -> settings:
    return settings(
        max_examples=_examples(count),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report_cases() -> Iterator[None]:
    yield
    print(
        f"\nKV fuzz cases run: {CASES} (total {sum(CASES.values())}); "
        f"puller: {PULLER_OUTCOMES}; decode engine pulls: {OUTCOMES}"
    )


# --------------------------------------------------------------------------- 1. the decoder
def _header(*, magic: bytes = MAGIC, version: int = VERSION, frame_type: int, length: int, crc: int) -> bytes:
    return HEADER.pack(magic, version, frame_type, 0, length, crc)


@st.composite
def _frame_bytes(draw: st.DrawFn) -> bytes:
    payload = draw(st.binary(max_size=200))
    frame_type = draw(st.integers(min_value=1, max_value=6))
    crc = zlib.crc32(payload)
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "valid",
                "bad_crc",
                "bad_length",
                "bad_magic",
                "bad_version",
                "bad_type",
                "huge",
                "truncated",
                "garbage",
            ]
        )
    )
    if kind == "valid":
        return _header(frame_type=frame_type, length=len(payload), crc=crc) + payload
    if kind == "bad_crc":
        return (
            _header(
                frame_type=frame_type,
                length=len(payload),
                crc=crc ^ draw(st.integers(min_value=1, max_value=2**32 - 1)),
            )
            + payload
        )
    if kind == "bad_length":
        length = draw(st.integers(min_value=0, max_value=400).filter(lambda n: n != len(payload)))
        return _header(frame_type=frame_type, length=length, crc=crc) + payload
    if kind == "bad_magic":
        magic = draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
        return _header(magic=magic, frame_type=frame_type, length=len(payload), crc=crc) + payload
    if kind == "bad_version":
        version = draw(st.integers(min_value=0, max_value=255).filter(lambda v: v != VERSION))
        return _header(version=version, frame_type=frame_type, length=len(payload), crc=crc) + payload
    if kind == "bad_type":
        bad = draw(st.sampled_from([0, 7, 8, 100, 255]))
        return _header(frame_type=bad, length=len(payload), crc=crc) + payload
    if kind == "huge":
        return _header(
            frame_type=frame_type, length=draw(st.integers(min_value=MAX_PAYLOAD + 1, max_value=2**32 - 1)), crc=crc
        )
    whole = _header(frame_type=frame_type, length=len(payload), crc=crc) + payload
    if kind == "truncated":
        return whole[: draw(st.integers(min_value=0, max_value=len(whole) - 1))]
    return draw(st.binary(min_size=1, max_size=64))


async def _decode_all(data: bytes) -> tuple[list[Frame], BaseException]:
    """Every frame the decoder returns from ``data`` arriving on a socket, and the error that
    ended it."""
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        channel = Channel(ours)
        try:
            return await _read_all(channel)
        finally:
            channel.close()


async def _read_all(channel: Channel) -> tuple[list[Frame], BaseException]:
    frames: list[Frame] = []
    while True:
        channel.expire_in(1.0)
        try:
            frame = await channel.read_frame(max_payload_bytes=MAX_PAYLOAD)
        except (FrameError, PeerClosed) as exc:
            return frames, exc
        assert len(frame.payload) <= MAX_PAYLOAD
        for accessor in (frame.json, frame.block):  # on a hostile payload: FrameError only
            with contextlib.suppress(FrameError):
                accessor()
        frames.append(frame)


@_settings(5000)
@given(st.one_of(st.binary(max_size=300), st.lists(_frame_bytes(), max_size=5).map(b"".join)))
def test_decoder_returns_only_checked_frames_and_fails_only_with_frame_errors(data: bytes) -> None:
    _count("decoder: hostile bytes")
    frames, _end = asyncio.run(_decode_all(data))
    consumed = 0
    for frame in frames:
        payload = frame.payload
        header = data[consumed : consumed + framing.HEADER_SIZE]
        magic, version, raw_type, _reserved, length, crc = HEADER.unpack(header)
        assert (magic, version, raw_type, length) == (MAGIC, VERSION, int(frame.type), len(payload))
        assert zlib.crc32(payload) == crc and data[consumed + framing.HEADER_SIZE :][:length] == payload
        consumed += framing.HEADER_SIZE + length


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@_settings(600)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(list(FrameType)), st.binary(max_size=MAX_PAYLOAD - 8)),
            st.dictionaries(st.text(max_size=8), _JSON, max_size=4),
        ),
        max_size=6,
    )
)
def test_valid_frames_round_trip(items: list[tuple[FrameType, bytes] | dict[str, Any]]) -> None:
    _count("decoder: round trip")
    data = b"".join(
        framing.encode_json(FrameType.DONE, item)
        if isinstance(item, dict)
        else framing.encode_header(frame_type=item[0], payload_len=len(item[1]), crc=zlib.crc32(item[1])) + item[1]
        for item in items
    )
    frames, end = asyncio.run(_decode_all(data))
    assert isinstance(end, PeerClosed) and end.received == 0  # a clean end
    assert len(frames) == len(items)
    for frame, item in zip(frames, items, strict=True):
        if isinstance(item, dict):
            assert frame.type is FrameType.DONE and frame.json() == item
        else:
            assert (frame.type, frame.payload) == item


# --------------------------------------------------------------------------- 2. the puller
@dataclasses.dataclass(frozen=True)
class Script:
    """What a hostile KV server answers to FETCH (rendered with the FETCH's nonce)."""

    before: bytes = b""
    error: tuple[str, str] | None = None
    proof: str = "valid"  # valid | missing | stranger | garbage
    layout_changes: tuple[tuple[str, Any], ...] = ()
    blocks: tuple[tuple[str, int], ...] = ()  # (action, argument) per BLOCK frame sent
    end: str = "done"  # done | close | garbage | huge | error | layout

    @property
    def is_clean(self) -> bool:
        return (
            not self.before
            and self.error is None
            and self.proof == "valid"
            and not self.layout_changes
            and self.end == "done"
            and all(action == "ok" for action, _ in self.blocks)
        )


BLOCK_ACTIONS = ["ok", "ok", "ok", "bad_crc", "wrong_index", "short", "long", "cut", "garbage", "not_a_block", "huge"]
LAYOUT_VALUES: list[Any] = [-1, 0, 1, 2, 3, 7, 2**31, 2**70, "3", None, 1.5, True, [], {}]


@st.composite
def _scripts(draw: st.DrawFn, *, num_blocks: int) -> Script:
    shape = draw(st.sampled_from(["clean", "deep", "deep", "any", "any", "any"]))
    if shape == "clean":
        return Script()
    num_frames = draw(st.integers(min_value=0, max_value=num_blocks + 2))
    if shape == "deep":  # an authenticated, well-formed start; trouble among the blocks
        return Script(
            blocks=tuple(
                draw(
                    st.lists(
                        st.tuples(st.sampled_from(["ok"] * 8 + BLOCK_ACTIONS), st.integers(min_value=1, max_value=300)),
                        min_size=num_frames,
                        max_size=num_frames,
                    )
                )
            ),
            end=draw(st.sampled_from(["done", "done", "close", "garbage", "huge", "error", "layout"])),
        )
    return Script(
        before=draw(st.sampled_from([b""] * 9 + [b"\x00" * 16, MAGIC + b"\x01\x02", b"GET / HTTP/1.1\r\n"])),
        error=draw(
            st.sampled_from(
                [None] * 7
                + [("unknown_request", ""), ("x" * 300, "\n" * 500), ("\n\r", "\x00"), ("layout_mismatch", "")]
            )
        ),
        proof=draw(st.sampled_from(["valid"] * 7 + ["missing", "stranger", "garbage"])),
        layout_changes=tuple(
            draw(
                st.sampled_from(
                    [[]] * 2
                    + [
                        draw(
                            st.lists(
                                st.tuples(
                                    st.sampled_from(
                                        ["num_blocks", "num_tokens", "first_block", "block_nbytes", "extra"]
                                    ),
                                    st.sampled_from(LAYOUT_VALUES),
                                ),
                                min_size=1,
                                max_size=2,
                            )
                        )
                    ]
                )
            )
        ),
        blocks=tuple(
            draw(
                st.lists(
                    st.tuples(st.sampled_from(BLOCK_ACTIONS), st.integers(min_value=1, max_value=300)),
                    min_size=num_frames,
                    max_size=num_frames,
                )
            )
        ),
        end=draw(st.sampled_from(["done", "done", "close", "garbage", "huge", "error", "layout"])),
    )


def _block_frame(*, action: str, arg: int, index: int, data: bytes) -> bytes:
    prefix = framing.BLOCK_INDEX.pack(index)
    if action == "wrong_index":
        prefix = framing.BLOCK_INDEX.pack((index + arg) % 2**32)
    elif action == "short":
        data = data[: max(0, len(data) - arg)]
    elif action == "long":
        data = data + bytes(min(arg, 64))  # within the reader's slack of 64 bytes
    elif action == "huge":
        return _header(frame_type=FrameType.BLOCK, length=2**31 + arg, crc=0)
    elif action == "garbage":
        return os.urandom(arg)
    payload = prefix + data
    frame_type = FrameType.DONE if action == "not_a_block" else FrameType.BLOCK
    crc = zlib.crc32(payload) ^ (arg if action == "bad_crc" else 0)
    whole = _header(frame_type=frame_type, length=len(payload), crc=crc) + payload
    return whole[: max(1, len(whole) - arg)] if action == "cut" else whole


class HostileKVServer:
    """A KV port that answers every FETCH with ``self.script`` over the true blocks."""

    def __init__(
        self, *, blocks: Callable[[str], list[bytes]], num_tokens: Callable[[str], int], layout: KVLayout
    ) -> None:
        self.script = Script()
        self._blocks = blocks
        self._num_tokens = num_tokens
        self._layout = layout
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script = self.script
        try:
            fetch = (await framing.read_frame(reader, timeout_seconds=5, max_payload_bytes=1 << 16)).json()
            request_id, nonce = str(fetch["request_id"]), str(fetch.get("nonce", ""))
            first_block = int(fetch["first_block"])
            blocks = self._blocks(request_id)
            writer.write(script.before)
            if script.error is not None:
                writer.write(
                    framing.encode_json(FrameType.ERROR, {"code": script.error[0], "message": script.error[1]})
                )
            header: dict[str, Any] = {
                "num_blocks": len(blocks),
                "num_tokens": self._num_tokens(request_id),
                "first_block": first_block,
                "block_nbytes": self._layout.block_nbytes,
            }
            for name, value in script.layout_changes:
                header[name] = value
            writer.write(
                framing.encode_json(
                    FrameType.LAYOUT,
                    {**header, **self._proof(script.proof, request_id=request_id, nonce=nonce, header=header)},
                )
            )
            # a clean script sends exactly the blocks asked for (the puller's prefix cache
            # decides the first one); any other sends its frames as drawn
            actions = [("ok", 0)] * (len(blocks) - first_block) if script.is_clean else script.blocks
            for offset, (action, arg) in enumerate(actions):
                index = first_block + offset
                data = blocks[index] if index < len(blocks) else os.urandom(self._layout.block_nbytes)
                writer.write(_block_frame(action=action, arg=arg, index=index, data=data))
                await writer.drain()
            writer.write(
                {
                    "done": framing.encode_json(FrameType.DONE, {"num_bytes": 0}),
                    "close": b"",
                    "garbage": b"\xff" * 20,
                    "huge": _header(frame_type=FrameType.DONE, length=2**32 - 1, crc=0),
                    "error": framing.encode_json(FrameType.ERROR, {"code": "protocol", "message": "late"}),
                    "layout": framing.encode_json(FrameType.LAYOUT, header),
                }[script.end]
            )
            await writer.drain()
            if script.end == "done":  # the puller answers RELEASE; a bad one may just hang up
                with contextlib.suppress(Exception):
                    await framing.read_frame(reader, timeout_seconds=2, max_payload_bytes=1 << 16)
        except (ConnectionError, asyncio.IncompleteReadError, FrameError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    def _proof(mode: str, *, request_id: str, nonce: str, header: dict[str, Any]) -> dict[str, Any]:
        if mode == "valid":
            return HandoffAuth(key=KEY).layout_proof(request_id=request_id, nonce=nonce, header=header)
        if mode == "stranger":
            return HandoffAuth(key=STRANGER).layout_proof(request_id=request_id, nonce=nonce, header=header)
        if mode == "garbage":
            return {"proof": "zz" * 32}
        return {}


NUM_BLOCKS = 4
TRUE_BLOCKS = [bytes([i + 1]) * LAYOUT.block_nbytes for i in range(NUM_BLOCKS)]
NUM_TOKENS = NUM_BLOCKS * LAYOUT.block_size - 1
TRANSFER_CODES = {
    "connect_failed",
    "timeout",
    "corrupt",
    "truncated",
    "unknown_request",
    "layout_mismatch",
    "protocol",
    "prompt_mismatch",
    "unauthorized",
    "unauthenticated",
}


@_settings(2000)
@given(script=_scripts(num_blocks=NUM_BLOCKS), first_block=st.integers(min_value=0, max_value=NUM_BLOCKS))
def test_puller_takes_only_a_complete_correct_stream(script: Script, first_block: int) -> None:
    _count("puller vs hostile server")

    async def run() -> None:
        server = HostileKVServer(blocks=lambda _r: TRUE_BLOCKS, num_tokens=lambda _r: NUM_TOKENS, layout=LAYOUT)
        server.script = script
        endpoint = await server.start()
        received: list[tuple[int, bytes]] = []
        try:
            result = await TcpKVConnector(auth=HandoffAuth(key=KEY)).fetch(
                endpoint=endpoint,
                request_id="req",
                first_block=first_block,
                layout=LAYOUT,
                on_block=lambda i, d: received.append((i, bytes(d))),
                timeout_seconds=1.0,
                expected_num_tokens=NUM_TOKENS,
            )
        except TransferError as exc:
            assert exc.code in TRANSFER_CODES, exc
            assert not server.script.is_clean, exc
            result = None
        finally:
            await server.stop()
        # whatever the outcome, the sink saw only the right blocks, in order, intact
        assert received == [(i, TRUE_BLOCKS[i]) for i in range(first_block, first_block + len(received))]
        outcome = (
            "complete" if result is not None else "refused after a block" if received else "refused before any block"
        )
        PULLER_OUTCOMES[outcome] = PULLER_OUTCOMES.get(outcome, 0) + 1
        if result is not None:
            assert received == [(i, TRUE_BLOCKS[i]) for i in range(first_block, NUM_BLOCKS)]
            assert result.num_tokens == NUM_TOKENS and result.num_blocks == NUM_BLOCKS - first_block

    asyncio.run(run())


# --------------------------------------------------------------------------- 3. the KV server
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@st.composite
def _pullers(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(bytes a puller sends, whether they carry a valid token for request "held")."""
    kind = draw(st.sampled_from(["garbage", "fetch", "fetch", "valid"]))
    if kind == "garbage":
        return draw(st.binary(max_size=100)), False
    body = draw(
        st.dictionaries(
            st.sampled_from(["request_id", "first_block", "layout", "nonce", "token", "x"]), _JSON, max_size=6
        )
    )
    if kind == "valid":
        nonce = draw(st.text(alphabet="0123456789abcdef", min_size=1, max_size=32))
        body.update(request_id="held", nonce=nonce, token=KEY.mac("fetch", {"request_id": "held", "nonce": nonce}))
        body.setdefault("layout", LAYOUT.to_json())
    return framing.encode_json(FrameType.FETCH, body), kind == "valid"


@_settings(800)
@given(_pullers())
def test_kv_server_tells_a_stranger_nothing(puller: tuple[bytes, bool]) -> None:
    _count("KV server vs hostile puller")
    data, authenticated = puller
    released: list[int] = []
    records = _Records()

    async def run() -> list[Frame]:
        registry = KVExportRegistry(ttl_seconds=60)
        registry.add(
            ExportedKV(
                request_id="held",
                num_tokens=NUM_TOKENS,
                num_blocks=NUM_BLOCKS,
                read_block=lambda i: memoryview(TRUE_BLOCKS[i]),
                release=lambda: released.append(1),
            )
        )
        server = TcpKVServer(
            registry=registry,
            layout=LAYOUT,
            host="127.0.0.1",
            port=0,
            io_timeout_seconds=0.5,
            auth=HandoffAuth(key=KEY),
        )
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(data)
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), timeout=5)
            writer.close()
        finally:
            await server.stop()
        frames, _ = await _decode_all(answer)
        return frames

    logging.getLogger("asyncio").addHandler(records)
    try:
        frames = asyncio.run(run())
    finally:
        logging.getLogger("asyncio").removeHandler(records)
    assert not records.records, [r.getMessage() for r in records.records]  # no unhandled error
    if not authenticated:
        assert all(f.type is FrameType.ERROR for f in frames) and len(frames) <= 1, frames
        assert all(f.json()["code"] == "unauthorized" for f in frames)
    assert released == []  # a RELEASE never came after a complete pull here


# --------------------------------------------------------------------------- 4. the decode engine
class _PullFailures(logging.Handler):
    """The transfer error codes of the decode engine's "KV pull ... failed (code X)" warnings."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.codes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("KV pull for request"):
            self.codes.append(str(record.args[2]) if isinstance(record.args, tuple) else "?")


class _LoopThread:
    """An event loop on a thread: the decode engine lives there across hypothesis examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_seconds: float = 60) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_seconds)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


ENGINE_MAX_TOKENS = 4


@dataclasses.dataclass(repr=False)
class DecodeRig:
    loop: _LoopThread
    engine: Any  # the AsyncEngine inside handoff
    handoff: Any  # HandoffEngine
    server: HostileKVServer
    endpoint: str
    prompts: list[list[int]]
    blocks: dict[str, list[bytes]]
    wanted: list[list[int]]


@pytest.fixture(scope="module")
def rig(tiny_llama_dir: Path) -> Iterator[DecodeRig]:
    from splitserve_contract import ServeArgs
    from splitserve_runtime.disagg.engine import HandoffEngine
    from splitserve_runtime.engine.async_engine import AsyncEngine
    from splitserve_runtime.engine.llm_engine import LLMEngine
    from splitserve_runtime.engine.sampling_params import SamplingParams

    args = ServeArgs(
        model=str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=48,
        max_model_len=128,
        max_num_batched_tokens=128,
        max_num_seqs=4,
    )
    prefill = LLMEngine.from_args(args)
    prompts = [[(37 * p + 11 * i) % 400 + 5 for i in range(length)] for p, length in enumerate((13, 24, 31, 40))]
    blocks: dict[str, list[bytes]] = {}
    wanted: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True)
        prefill.add_request(request_id=f"want-{index}", prompt_token_ids=prompt, params=params)
        tokens: list[int] = []
        while prefill.has_unfinished():
            tokens.extend(t for out in prefill.step() for t in out.new_token_ids)
        wanted.append(tokens)
        prefill.add_request(
            request_id=f"p{index}",
            prompt_token_ids=prompt,
            keep_kv=True,
            params=dataclasses.replace(params, max_tokens=1),
        )
        while prefill.has_unfinished():
            prefill.step()
        kept = prefill.kept_kv(f"p{index}")
        assert kept is not None
        blocks[f"p{index}"] = [bytes(prefill.runner.read_block(b)) for b in kept.block_ids]
    loop = _LoopThread()
    engine = AsyncEngine(engine=LLMEngine.from_args(args))
    handoff = HandoffEngine(
        engine=engine,
        role="decode",
        compat_hash="fuzz",
        kv_host="127.0.0.1",
        kv_port=0,
        kv_endpoint="",
        kv_ttl_seconds=30,
        fetch_timeout_seconds=1.0,
        auth=HandoffAuth(key=KEY),
    )
    loop.run(handoff.start())
    layout = handoff.layout
    server = HostileKVServer(blocks=lambda r: blocks[r], layout=layout, num_tokens=lambda r: len(prompts[int(r[1:])]))
    endpoint = loop.run(server.start())
    try:
        yield DecodeRig(
            loop=loop,
            engine=engine,
            handoff=handoff,
            server=server,
            endpoint=endpoint,
            prompts=prompts,
            blocks=blocks,
            wanted=wanted,
        )
    finally:
        loop.run(server.stop())
        loop.run(handoff.shutdown())
        loop.close()


@_settings(250)
@given(data=st.data(), prompt_index=st.integers(min_value=0, max_value=3), forget_cache=st.booleans())
def test_decode_engine_never_uses_a_bad_stream(
    rig: DecodeRig, data: st.DataObject, prompt_index: int, forget_cache: bool
) -> None:
    from splitserve_runtime.engine.sampling_params import SamplingParams

    _count("decode engine vs hostile server")
    prompt, wanted = rig.prompts[prompt_index], rig.wanted[prompt_index]
    num_blocks = math.ceil(len(prompt) / 8)
    rig.server.script = data.draw(_scripts(num_blocks=num_blocks))
    handoff = rig.handoff
    source = handoff.accept_remote(
        HandoffAuth(key=KEY).sign(
            {
                "remote_endpoint": rig.endpoint,
                "remote_request_id": f"p{prompt_index}",
                "num_prompt_tokens": len(prompt),
                "first_token_id": wanted[0],
                "compat_hash": "fuzz",
                "prompt_digest": prompt_digest(prompt),
            },
            lifetime_seconds=60,
        ),
        prompt_token_ids=prompt,
    )

    async def run() -> list[int]:
        if forget_cache:
            await rig.engine.call(lambda core: core.block_manager.reset_prefix_cache())
        tokens: list[int] = []
        async for out in handoff.generate_from_remote(
            request_id=f"fz-{CASES['decode engine vs hostile server']}",
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True),
            source=source,
        ):
            tokens.extend(out.new_token_ids)
        return tokens

    failures = _PullFailures()
    logging.getLogger("splitserve_runtime.disagg.decode_import").addHandler(failures)
    try:
        assert rig.loop.run(run()) == wanted  # the pull or the local compute: the same answer
    finally:
        logging.getLogger("splitserve_runtime.disagg.decode_import").removeHandler(failures)
    outcome = failures.codes[0] if failures.codes else "pulled"
    assert len(failures.codes) <= 1 and (outcome == "pulled" or not rig.server.script.is_clean), outcome
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    usage, reserved = rig.loop.run(rig.engine.call(lambda core: (core.block_manager.usage_ratio, len(core._reserved))))
    assert usage == 0.0 and reserved == 0  # nothing held: the reservation was freed


# --------------------------------------------------------------------------- 5. the handoff parameters
HANDOFF_FIELDS = (
    "remote_endpoint",
    "remote_request_id",
    "num_prompt_tokens",
    "first_token_id",
    "compat_hash",
    "prompt_digest",
    "expires_at",
    "signature",
)
BINDING_FIELDS = frozenset({"num_prompt_tokens", "prompt_digest", "compat_hash", "remote_endpoint"})
"""What is checked without a key (the endpoint: loopback only, so a loopback one still passes)."""


@st.composite
def _presented_prompt(draw: st.DrawFn, prompt: list[int]) -> list[int]:
    """The prompt the parameters come with: their own, or another one close to it or not."""
    kind = draw(st.sampled_from(["own", "own", "one_token", "prefix", "longer", "swapped", "any"]))
    if kind == "own":
        return list(prompt)
    if kind == "one_token":
        index = draw(st.integers(min_value=0, max_value=len(prompt) - 1))
        token = draw(st.integers(min_value=0, max_value=2**31).filter(lambda t: t != prompt[index]))
        return [*prompt[:index], token, *prompt[index + 1 :]]
    if kind == "prefix":
        return prompt[: draw(st.integers(min_value=0, max_value=len(prompt) - 1))]
    if kind == "longer":
        return [*prompt, *draw(st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=8))]
    if kind == "swapped" and len(set(prompt)) > 1:
        return [*prompt[1:], prompt[0]] if prompt[1:] + [prompt[0]] != prompt else list(reversed(prompt))
    return draw(st.lists(st.integers(min_value=0, max_value=2**31), max_size=80))


@_settings(600)
@given(
    data=st.data(),
    keyed=st.booleans(),
    prompt=st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=80),
)
def test_handoff_params_pass_only_untouched_and_with_their_own_prompt(
    data: st.DataObject, keyed: bool, prompt: list[int]
) -> None:
    from splitserve_runtime.transfer import HandoffRejected

    _count("handoff parameters")
    auth = HandoffAuth(key=KEY if keyed else None)
    genuine = auth.sign(
        {
            "remote_endpoint": "127.0.0.1:8100",
            "remote_request_id": "cmpl-1",
            "num_prompt_tokens": len(prompt),
            "first_token_id": 3,
            "compat_hash": "fuzz",
            "prompt_digest": prompt_digest(prompt),
        },
        lifetime_seconds=60,
    )
    params = dict(genuine)
    field = data.draw(st.sampled_from([name for name in HANDOFF_FIELDS if name in genuine]))
    tamper = data.draw(st.sampled_from(["none", "none", "alter", "drop", "retype"]))
    if tamper == "alter":
        value = data.draw(st.one_of(st.text(max_size=70), st.integers(min_value=-(2**40), max_value=2**40)))
        if isinstance(genuine[field], str) and data.draw(st.booleans()):  # a near miss: one character
            text = genuine[field]
            value = text[:-1] + ("0" if text[-1:] != "0" else "1")
        params[field] = value
    elif tamper == "drop":
        del params[field]
    elif tamper == "retype":
        params[field] = data.draw(st.sampled_from([None, True, 1.5, [], {}, str(genuine[field])]))
    presented = data.draw(_presented_prompt(prompt))
    changed = params != genuine
    try:
        auth.check_params(params, compat_hash="fuzz", prompt_token_ids=presented)
        accepted, code = True, ""
    except HandoffRejected as exc:
        accepted, code = False, exc.code
    own_prompt = presented == prompt
    if not changed and own_prompt:
        assert accepted, code
    if not own_prompt:  # whatever was done to the parameters: never for another prompt
        assert not accepted
        if not changed:
            assert code == "prompt_mismatch"
    if keyed and changed:  # nothing signed can be changed
        assert not accepted
    if not keyed and changed and field in BINDING_FIELDS and field != "remote_endpoint":
        assert not accepted  # the binding holds without a key too
