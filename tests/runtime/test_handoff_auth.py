"""KV handoff authentication (issue 12, defect 4): the signed handoff parameters and the
authenticated KV connection, over real loopback sockets.

Decode side: parameters that are unsigned, forged, altered, expired or from another pool are
refused; without a key only loopback endpoints are. KV port: a puller without a valid token
gets an ERROR and nothing else (no LAYOUT, no BLOCK, and the export stays for the real
puller); a server that cannot prove it holds the key gets no block into the sink.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from splitserve_runtime.transfer import (
    ExportedKV,
    HandoffAuth,
    HandoffKey,
    HandoffRejected,
    KVExportRegistry,
    KVLayout,
    TcpKVConnector,
    TcpKVServer,
    TransferError,
    framing,
)
from splitserve_runtime.transfer.auth import CLOCK_SKEW_SECONDS, SIGNATURE_FIELD
from splitserve_runtime.transfer.framing import FrameType

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  dtype_bytes=4, compat_hash="pool-a")
KEY = HandoffKey(b"k" * 32)
OTHER_KEY = HandoffKey(b"another InferenceService's key")


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _params(**overrides: Any) -> dict[str, Any]:
    return {"remote_endpoint": "10.1.2.3:8100", "remote_request_id": "cmpl-1",
            "num_prompt_tokens": 21, "first_token_id": 7, "compat_hash": "pool-a", **overrides}


def _refusal(auth: HandoffAuth, params: dict[str, Any], *, compat_hash: str = "pool-a") -> str:
    with pytest.raises(HandoffRejected) as info:
        auth.check_params(params, compat_hash=compat_hash)
    return info.value.code


# --------------------------------------------------------------------------- the key
def test_key_file_is_read_without_its_newline_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"s3cret-s3cret-s3cret-s3cret\n")
    key = HandoffKey.from_file(path)
    assert key.mac("params", {"a": 1}) == HandoffKey(b"s3cret-s3cret-s3cret-s3cret").mac("params", {"a": 1})
    assert "s3cret" not in repr(key) and "s3cret" not in repr(HandoffAuth(key=key))
    binary = b" \t" + bytes(range(1, 31)) + b" "  # leading/trailing whitespace bytes are key bytes
    path.write_bytes(binary)
    assert HandoffKey.from_file(path).mac("params", {}) == HandoffKey(binary).mac("params", {})
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16 bytes") as short:
        HandoffKey.from_file(path)
    assert "short" not in str(short.value).replace("at least", "")
    with pytest.raises(ValueError, match="cannot read"):
        HandoffKey.from_file(tmp_path / "missing")


def test_macs_are_bound_to_their_purpose() -> None:
    body = {"request_id": "r", "nonce": "n"}
    assert KEY.mac("fetch", body) != KEY.mac("layout", body) != KEY.mac("params", body)
    assert KEY.verify("fetch", body, KEY.mac("fetch", body))
    for bad in (None, 5, "", "0" * 64, KEY.mac("fetch", body).upper(), "\ud800" * 64, OTHER_KEY.mac("fetch", body)):
        assert not KEY.verify("fetch", body, bad)


# --------------------------------------------------------------------------- handoff parameters
def test_signed_params_are_accepted_until_they_expire() -> None:
    clock = Clock()
    auth = HandoffAuth(key=KEY, clock=clock)
    signed = auth.sign(_params(), lifetime_seconds=30)
    assert signed["expires_at"] == clock.now + 30 and len(signed[SIGNATURE_FIELD]) == 64
    auth.check_params(signed, compat_hash="pool-a")
    clock.now += 30 + CLOCK_SKEW_SECONDS  # the last second the skew allows
    auth.check_params(signed, compat_hash="pool-a")
    clock.now += 1
    assert _refusal(auth, signed) == "expired"


@pytest.mark.parametrize(("field", "value"), [
    ("remote_endpoint", "127.0.0.1:22"), ("remote_request_id", "cmpl-2"), ("num_prompt_tokens", 22),
    ("first_token_id", 8), ("compat_hash", "pool-b"), ("expires_at", 1_800_000_000), ("extra", 1),
])
def test_any_altered_field_breaks_the_signature(field: str, value: object) -> None:
    auth = HandoffAuth(key=KEY, clock=Clock())
    signed = auth.sign(_params(), lifetime_seconds=30)
    assert _refusal(auth, {**signed, field: value}) == "bad_signature"


def test_unsigned_foreign_and_other_pool_params_are_refused() -> None:
    clock = Clock()
    auth = HandoffAuth(key=KEY, clock=clock)
    assert _refusal(auth, _params()) == "unsigned"
    assert _refusal(auth, HandoffAuth(key=OTHER_KEY, clock=clock).sign(_params(), lifetime_seconds=30)) == "bad_signature"
    assert _refusal(auth, {**_params(), "expires_at": 2_000_000_000, SIGNATURE_FIELD: "ab" * 32}) == "bad_signature"
    assert _refusal(auth, {**_params(), SIGNATURE_FIELD: float("nan")}) == "bad_signature"
    other_pool = auth.sign(_params(compat_hash="pool-b"), lifetime_seconds=30)  # same key, other hash
    assert _refusal(auth, other_pool) == "compat_mismatch"
    with pytest.raises(HandoffRejected) as nan:  # a value no canonical encoding exists for
        auth.check_params({**_params(extra=float("nan")), SIGNATURE_FIELD: "ab" * 32}, compat_hash="pool-a")
    assert nan.value.code == "malformed"


@pytest.mark.parametrize(("endpoint", "allowed"), [
    ("127.0.0.1:8100", True), ("127.0.0.98:1", True), ("[::1]:8100", True), ("localhost:8100", True),
    ("10.0.0.7:8100", False), ("169.254.169.254:80", False), ("example.com:80", False),
    ("[2001:db8::1]:8100", False), ("127.0.0.1", False), ("", False),
])
def test_without_a_key_only_loopback_endpoints_are_accepted(endpoint: str, allowed: bool) -> None:
    auth = HandoffAuth(key=None)
    params = _params(remote_endpoint=endpoint)
    if allowed:
        auth.check_params(params, compat_hash="pool-a")
        auth.check_endpoint(endpoint)
    else:
        assert _refusal(auth, params) == "endpoint_not_allowed"
        with pytest.raises(HandoffRejected):
            auth.check_endpoint(endpoint)
    assert _refusal(auth, _params(remote_endpoint="127.0.0.1:1", compat_hash="x")) == "compat_mismatch"
    assert auth.sign(params, lifetime_seconds=30) == params  # nothing to sign with


# --------------------------------------------------------------------------- the KV connection
class Export:
    def __init__(self, request_id: str, num_blocks: int = 3) -> None:
        self.blocks = [os.urandom(LAYOUT.block_nbytes) for _ in range(num_blocks)]
        self.released = 0
        self.exported = ExportedKV(request_id=request_id, num_tokens=num_blocks * LAYOUT.block_size - 2,
                                   num_blocks=num_blocks, read_block=lambda i: memoryview(self.blocks[i]),
                                   release=self._release)

    def _release(self) -> None:
        self.released += 1


async def _kv_server(*, key: HandoffKey | None, export: Export) -> TcpKVServer:
    registry = KVExportRegistry(ttl_seconds=30)
    registry.add(export.exported)
    server = TcpKVServer(registry=registry, layout=LAYOUT, host="127.0.0.1", port=0,
                         io_timeout_seconds=2.0, auth=HandoffAuth(key=key))
    await server.start()
    return server


async def _pull(port: int, *, key: HandoffKey | None, request_id: str,
                received: list[int]) -> Any:
    return await TcpKVConnector(auth=HandoffAuth(key=key)).fetch(
        endpoint=f"127.0.0.1:{port}", request_id=request_id, first_block=0, layout=LAYOUT,
        on_block=lambda i, _d: received.append(i), timeout_seconds=2.0,
        expected_num_tokens=3 * LAYOUT.block_size - 2)


async def test_pods_with_the_key_move_kv_and_a_puller_without_it_gets_nothing() -> None:
    export = Export("r1")
    server = await _kv_server(key=KEY, export=export)
    try:
        for puller_key in (None, OTHER_KEY):
            received: list[int] = []
            with pytest.raises(TransferError) as refused:
                await _pull(server.port, key=puller_key, request_id="r1", received=received)
            assert refused.value.code == "unauthorized" and received == []
        assert export.released == 0  # the export waits for the real puller
        received = []
        result = await _pull(server.port, key=KEY, request_id="r1", received=received)
        assert received == [0, 1, 2] and result.num_blocks == 3
        for _ in range(200):
            if export.released:
                break
            await asyncio.sleep(0.01)
        assert export.released == 1
    finally:
        await server.stop()


@pytest.mark.parametrize("credentials", [
    {}, {"nonce": "abc"}, {"nonce": "abc", "token": "0" * 64}, {"nonce": 5, "token": None},
    {"nonce": "n" * 65, "token": KEY.mac("fetch", {"request_id": "r2", "nonce": "n" * 65})},
    {"nonce": "abc", "token": KEY.mac("fetch", {"request_id": "someone-else", "nonce": "abc"})},
    {"nonce": "abc", "token": KEY.mac("layout", {"request_id": "r2", "nonce": "abc"})},
])
async def test_a_raw_fetch_without_a_valid_token_is_answered_with_an_error_only(
        credentials: dict[str, Any]) -> None:
    """The stranger's view of the KV port: one ERROR frame, then the connection closes; not
    a LAYOUT, not a BLOCK, not whether the request exists."""
    export = Export("r2")
    server = await _kv_server(key=KEY, export=export)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(framing.encode_json(FrameType.FETCH, {
            "request_id": "r2", "first_block": 0, "layout": LAYOUT.to_json(), **credentials}))
        await writer.drain()
        frame = await framing.read_frame(reader, timeout_seconds=2, max_payload_bytes=1 << 16)
        assert frame.type is FrameType.ERROR and frame.json()["code"] == "unauthorized"
        assert await asyncio.wait_for(reader.read(), timeout=2) == b""  # closed, nothing more
        writer.close()
    finally:
        await server.stop()
    assert export.released == 0


async def test_a_server_without_the_key_gets_no_block_into_the_sink() -> None:
    """A stranger answering on the prefill pod's address with a well-formed stream (valid
    counts, CRCs, every block): without the LAYOUT proof the puller takes none of it."""
    fetches: list[dict[str, Any]] = []

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fetch = (await framing.read_frame(reader, timeout_seconds=2, max_payload_bytes=1 << 16)).json()
        fetches.append(fetch)
        writer.write(framing.encode_json(FrameType.LAYOUT, {
            "num_blocks": 3, "num_tokens": 10, "first_block": 0, "block_nbytes": LAYOUT.block_nbytes,
            "proof": OTHER_KEY.mac("layout", {"request_id": fetch["request_id"], "nonce": fetch["nonce"]})}))
        for index in range(3):
            framing.write_block(writer, index=index, data=os.urandom(LAYOUT.block_nbytes))
        writer.write(framing.encode_json(FrameType.DONE, {"num_bytes": 0}))
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    async with server:
        received: list[int] = []
        with pytest.raises(TransferError) as info:
            await TcpKVConnector(auth=HandoffAuth(key=KEY)).fetch(
                endpoint=f"127.0.0.1:{server.sockets[0].getsockname()[1]}", request_id="r3",
                first_block=0, layout=LAYOUT, on_block=lambda i, _d: received.append(i),
                timeout_seconds=2.0)
    assert info.value.code == "unauthenticated" and received == []
    # and the puller proved itself: its FETCH carried a nonce and a token for this request
    assert KEY.verify("fetch", {"request_id": "r3", "nonce": fetches[0]["nonce"]}, fetches[0]["token"])


async def test_without_a_key_the_connector_connects_only_to_loopback() -> None:
    with pytest.raises(TransferError) as info:
        await TcpKVConnector().fetch(endpoint="10.255.255.1:8100", request_id="r", first_block=0,
                                     layout=LAYOUT, on_block=lambda i, d: None, timeout_seconds=0.5)
    assert info.value.code == "endpoint_not_allowed"


def test_without_a_key_the_server_serves_only_loopback_peers() -> None:
    auth = HandoffAuth(key=None)
    assert auth.check_fetch({"request_id": "r"}, peer_host="127.0.0.5") == ""
    assert auth.check_fetch({"request_id": "r"}, peer_host="::1") == ""
    for peer in ("10.0.0.9", "192.168.1.2", "", "fe80::1"):
        with pytest.raises(HandoffRejected) as info:
            auth.check_fetch({"request_id": "r"}, peer_host=peer)
        assert info.value.code == "unauthorized"


# --------------------------------------------------------------------------- start-up
def test_a_pod_whose_key_file_cannot_be_read_does_not_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A prefill or decode pod never falls back to the unauthenticated mode because its key
    is missing: it exits 1 and says why in its termination message."""
    from server_harness import serve_args, serve_until_exit

    missing = tmp_path / "no-such-key"
    code, output, message = serve_until_exit(
        args=serve_args(model_dir=tiny_llama_dir, role="decode", port=0, kv_port=0, handoff_key_file=str(missing)),
        termination_log=tmp_path / "termination-log")
    assert code == 1, output
    assert "KV handoff key file" in message and str(missing) in message, message
