"""KV handoff authentication (issue 12, defect 4): the signed handoff parameters and the
authenticated KV connection, over real loopback sockets.

Decode side: parameters that are unsigned, forged, altered, expired or from another pool are
refused; without a key only loopback endpoints are. With or without a key, parameters computed
for another prompt than the one presented with them are refused (``prompt_mismatch``: the
cross-user prefix-cache poisoning defect, where prompt A's signed parameters came with prompt B
of the same length and B's block hashes then named A's KV). KV port: a puller without a valid token
gets an ERROR and nothing else (no LAYOUT, no BLOCK, and the export stays for the real
puller); a server that cannot prove it holds the key gets no block into the sink.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract.block_hash import prompt_digest
from splitserve_contract.handoff import PROMPT_DIGEST as PROMPT_DIGEST_FIELD
from splitserve_contract.handoff import SIGNATURE as SIGNATURE_FIELD
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
from splitserve_runtime.transfer.auth import CLOCK_SKEW_SECONDS
from splitserve_runtime.transfer.framing import FrameType

LAYOUT = KVLayout(
    num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32", dtype_bytes=4, compat_hash="pool-a"
)
KEY = HandoffKey(b"k" * 32)
OTHER_KEY = HandoffKey(b"another InferenceService's key")
PROMPT = tuple(range(100, 121))
"""The prompt (21 token ids) the parameters below were computed for."""
OTHER_PROMPT = (*PROMPT[:-1], 7)
"""Another prompt of the same length (its last token differs)."""


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _params(**overrides: Any) -> dict[str, Any]:
    return {
        "remote_endpoint": "10.1.2.3:8100",
        "remote_request_id": "cmpl-1",
        "num_prompt_tokens": 21,
        "first_token_id": 7,
        "compat_hash": "pool-a",
        PROMPT_DIGEST_FIELD: prompt_digest(PROMPT),
        **overrides,
    }


def _refusal(
    auth: HandoffAuth, params: dict[str, Any], *, compat_hash: str = "pool-a", prompt: tuple[int, ...] = PROMPT
) -> str:
    with pytest.raises(HandoffRejected) as info:
        auth.check_params(params, compat_hash=compat_hash, prompt_token_ids=prompt)
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
    auth.check_params(signed, compat_hash="pool-a", prompt_token_ids=PROMPT)
    clock.now += 30 + CLOCK_SKEW_SECONDS  # the last second the skew allows
    auth.check_params(signed, compat_hash="pool-a", prompt_token_ids=PROMPT)
    clock.now += 1
    assert _refusal(auth, signed) == "expired"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_endpoint", "127.0.0.1:22"),
        ("remote_request_id", "cmpl-2"),
        ("num_prompt_tokens", 22),
        ("first_token_id", 8),
        ("compat_hash", "pool-b"),
        ("expires_at", 1_800_000_000),
        ("extra", 1),
        (PROMPT_DIGEST_FIELD, prompt_digest(OTHER_PROMPT)),
        (PROMPT_DIGEST_FIELD, "0" * 64),
    ],
)
def test_any_altered_field_breaks_the_signature(field: str, value: object) -> None:
    auth = HandoffAuth(key=KEY, clock=Clock())
    signed = auth.sign(_params(), lifetime_seconds=30)
    assert _refusal(auth, {**signed, field: value}) == "bad_signature"


def test_unsigned_foreign_and_other_pool_params_are_refused() -> None:
    clock = Clock()
    auth = HandoffAuth(key=KEY, clock=clock)
    assert _refusal(auth, _params()) == "unsigned"
    assert (
        _refusal(auth, HandoffAuth(key=OTHER_KEY, clock=clock).sign(_params(), lifetime_seconds=30)) == "bad_signature"
    )
    assert _refusal(auth, {**_params(), "expires_at": 2_000_000_000, SIGNATURE_FIELD: "ab" * 32}) == "bad_signature"
    assert _refusal(auth, {**_params(), SIGNATURE_FIELD: float("nan")}) == "bad_signature"
    other_pool = auth.sign(_params(compat_hash="pool-b"), lifetime_seconds=30)  # same key, other hash
    assert _refusal(auth, other_pool) == "compat_mismatch"
    with pytest.raises(HandoffRejected) as nan:  # a value no canonical encoding exists for
        auth.check_params(
            {**_params(extra=float("nan")), SIGNATURE_FIELD: "ab" * 32}, compat_hash="pool-a", prompt_token_ids=PROMPT
        )
    assert nan.value.code == "malformed"


@pytest.mark.parametrize(
    ("endpoint", "allowed"),
    [
        ("127.0.0.1:8100", True),
        ("127.0.0.98:1", True),
        ("[::1]:8100", True),
        ("localhost:8100", True),
        ("10.0.0.7:8100", False),
        ("169.254.169.254:80", False),
        ("example.com:80", False),
        ("[2001:db8::1]:8100", False),
        ("127.0.0.1", False),
        ("", False),
    ],
)
def test_without_a_key_only_loopback_endpoints_are_accepted(endpoint: str, allowed: bool) -> None:
    auth = HandoffAuth(key=None)
    params = _params(remote_endpoint=endpoint)
    if allowed:
        auth.check_params(params, compat_hash="pool-a", prompt_token_ids=PROMPT)
        auth.check_endpoint(endpoint)
    else:
        assert _refusal(auth, params) == "endpoint_not_allowed"
        with pytest.raises(HandoffRejected):
            auth.check_endpoint(endpoint)
    assert _refusal(auth, _params(remote_endpoint="127.0.0.1:1", compat_hash="x")) == "compat_mismatch"
    assert auth.sign(params, lifetime_seconds=30) == params  # nothing to sign with


# --------------------------------------------------------------------------- the prompt binding
def _without(params: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != field}


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "loopback-no-key"])
def test_params_are_accepted_only_with_the_prompt_they_were_computed_for(keyed: bool) -> None:
    """Tampering with the prompt binding, with and without a key: every case is refused, and
    without a key (where nothing is signed) each is a prompt_mismatch of its own."""
    auth = HandoffAuth(key=KEY if keyed else None, clock=Clock())
    base = _params(remote_endpoint="127.0.0.1:8100")

    def sign(params: dict[str, Any]) -> dict[str, Any]:
        return auth.sign(params, lifetime_seconds=30)

    signed = sign(base)
    auth.check_params(signed, compat_hash="pool-a", prompt_token_ids=PROMPT)  # the control
    auth.check_params(signed, compat_hash="pool-a", prompt_token_ids=list(PROMPT))  # a list, as the server has
    tampered = {  # after signing: the signature breaks with a key, the binding without one
        "digest altered": {**signed, PROMPT_DIGEST_FIELD: prompt_digest(OTHER_PROMPT)},
        "digest removed": _without(signed, PROMPT_DIGEST_FIELD),
        "digest emptied": {**signed, PROMPT_DIGEST_FIELD: ""},
        "length off by one": {**signed, "num_prompt_tokens": len(PROMPT) + 1},
    }
    for case, params in tampered.items():
        assert _refusal(auth, params) == ("bad_signature" if keyed else "prompt_mismatch"), case
    genuine = {  # signed as they are, by a pod holding the key: the binding alone refuses them
        "another prompt's digest": sign({**base, PROMPT_DIGEST_FIELD: prompt_digest(OTHER_PROMPT)}),
        "no digest at all": sign(_without(base, PROMPT_DIGEST_FIELD)),
        "a shorter prompt's length and digest": sign(
            {**base, "num_prompt_tokens": 20, PROMPT_DIGEST_FIELD: prompt_digest(PROMPT[:20])}
        ),
        "the length of another prompt": sign({**base, "num_prompt_tokens": 22}),
        "a digest that is not a string": sign({**base, PROMPT_DIGEST_FIELD: 5}),
    }
    for case, params in genuine.items():
        assert _refusal(auth, params) == "prompt_mismatch", case
    # and the right parameters presented with the wrong prompt: same length, a prefix, longer
    for prompt in (OTHER_PROMPT, PROMPT[:20], (*PROMPT, 1), tuple(reversed(PROMPT)), ()):
        assert _refusal(auth, signed, prompt=prompt) == "prompt_mismatch", prompt


def test_the_prompt_digest_names_every_token_in_order() -> None:
    """The one definition in the contract: stable across processes (a fixed value), and
    different for any change of a token, their order or their number, the partial last block
    included (the prefix-cache block hashes cover only full blocks)."""
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    assert prompt_digest([1, 2, 3]) == "053d7dc294bd6816f7cd2f777f6ea0aff2da0c997b139b03e4a0e1e314194b04"
    digests = {
        prompt_digest(p)
        for p in (
            [],
            [0],
            [0, 0],
            [1],
            [1, 2, 3],
            [3, 2, 1],
            [1, 2, 3, 0],
            [2**40],
            [-1],
            list(range(33)),
            [*range(32), 99],
        )
    }
    assert len(digests) == 11 and all(len(d) == 64 and int(d, 16) >= 0 for d in digests)
    with pytest.raises(ValueError, match="64-bit"):
        prompt_digest([2**64])


# --------------------------------------------------------------------------- the KV connection
class Export:
    def __init__(self, request_id: str, num_blocks: int = 3) -> None:
        self.blocks = [os.urandom(LAYOUT.block_nbytes) for _ in range(num_blocks)]
        self.released = 0
        self.exported = ExportedKV(
            request_id=request_id,
            num_tokens=num_blocks * LAYOUT.block_size - 2,
            num_blocks=num_blocks,
            read_block=lambda i: memoryview(self.blocks[i]),
            release=self._release,
        )

    def _release(self) -> None:
        self.released += 1


async def _kv_server(*, key: HandoffKey | None, export: Export) -> TcpKVServer:
    registry = KVExportRegistry(ttl_seconds=30)
    registry.add(export.exported)
    server = TcpKVServer(
        registry=registry, layout=LAYOUT, host="127.0.0.1", port=0, io_timeout_seconds=2.0, auth=HandoffAuth(key=key)
    )
    await server.start()
    return server


async def _pull(port: int, *, key: HandoffKey | None, request_id: str, received: list[int]) -> Any:
    return await TcpKVConnector(auth=HandoffAuth(key=key)).fetch(
        endpoint=f"127.0.0.1:{port}",
        request_id=request_id,
        first_block=0,
        layout=LAYOUT,
        on_block=lambda i, _d: received.append(i),
        timeout_seconds=2.0,
        expected_num_tokens=3 * LAYOUT.block_size - 2,
    )


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


@pytest.mark.parametrize(
    "credentials",
    [
        {},
        {"nonce": "abc"},
        {"nonce": "abc", "token": "0" * 64},
        {"nonce": 5, "token": None},
        {"nonce": "n" * 65, "token": KEY.mac("fetch", {"request_id": "r2", "nonce": "n" * 65})},
        {"nonce": "abc", "token": KEY.mac("fetch", {"request_id": "someone-else", "nonce": "abc"})},
        {"nonce": "abc", "token": KEY.mac("layout", {"request_id": "r2", "nonce": "abc"})},
    ],
)
async def test_a_raw_fetch_without_a_valid_token_is_answered_with_an_error_only(credentials: dict[str, Any]) -> None:
    """The stranger's view of the KV port: one ERROR frame, then the connection closes; not
    a LAYOUT, not a BLOCK, not whether the request exists."""
    export = Export("r2")
    server = await _kv_server(key=KEY, export=export)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            framing.encode_json(
                FrameType.FETCH, {"request_id": "r2", "first_block": 0, "layout": LAYOUT.to_json(), **credentials}
            )
        )
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
        writer.write(
            framing.encode_json(
                FrameType.LAYOUT,
                {
                    "num_blocks": 3,
                    "num_tokens": 10,
                    "first_block": 0,
                    "block_nbytes": LAYOUT.block_nbytes,
                    "proof": OTHER_KEY.mac("layout", {"request_id": fetch["request_id"], "nonce": fetch["nonce"]}),
                },
            )
        )
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
                endpoint=f"127.0.0.1:{server.sockets[0].getsockname()[1]}",
                request_id="r3",
                first_block=0,
                layout=LAYOUT,
                on_block=lambda i, _d: received.append(i),
                timeout_seconds=2.0,
            )
    assert info.value.code == "unauthenticated" and received == []
    # and the puller proved itself: its FETCH carried a nonce and a token for this request
    assert KEY.verify("fetch", {"request_id": "r3", "nonce": fetches[0]["nonce"]}, fetches[0]["token"])


async def test_without_a_key_the_connector_connects_only_to_loopback() -> None:
    with pytest.raises(TransferError) as info:
        await TcpKVConnector().fetch(
            endpoint="10.255.255.1:8100",
            request_id="r",
            first_block=0,
            layout=LAYOUT,
            on_block=lambda i, d: None,
            timeout_seconds=0.5,
        )
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
        termination_log=tmp_path / "termination-log",
    )
    assert code == 1, output
    assert "KV handoff key file" in message and str(missing) in message, message


# ------------------------------------------------------------------ a named prefill pod's identity
@pytest.mark.parametrize("named", ["10.0.0.7:8000", "[fd00::7]:8000", "[FD00:0::7]:08000"])
def test_a_named_pod_proves_its_identity_only_for_its_own_address(named: str) -> None:
    """The proof a decode pod asks of an address an endpoint picker named (``--prefill-headers``)
    binds the nonce, the role and the pod's own address: a relay that passes a real pod's proof
    on fails, and so do another key, another nonce and another role."""
    own = "[fd00::7]:8000" if "fd00" in named.lower() else "10.0.0.7:8000"
    nonce = HandoffAuth.new_nonce()
    proof = HandoffAuth(key=KEY).identity_proof(nonce=nonce, role="prefill", endpoint=own)
    decode = HandoffAuth(key=KEY)
    decode.check_identity(endpoint=named, nonce=nonce, role="prefill", proof=proof)  # one address, any spelling
    refused = [
        dict(endpoint="10.0.0.8:8000", nonce=nonce, role="prefill", proof=proof),  # a relay's address
        dict(endpoint=named, nonce=HandoffAuth.new_nonce(), role="prefill", proof=proof),  # replayed
        dict(endpoint=named, nonce=nonce, role="decode", proof=proof),
        dict(endpoint=named, nonce=nonce, role="prefill", proof=None),
        dict(
            endpoint=named,
            nonce=nonce,
            role="prefill",
            proof=HandoffAuth(key=OTHER_KEY).identity_proof(nonce=nonce, role="prefill", endpoint=own),
        ),
    ]
    for case in refused:
        with pytest.raises(HandoffRejected) as refusal:
            decode.check_identity(**case)  # type: ignore[arg-type]
        assert refusal.value.code == "unauthenticated"


def test_without_a_key_a_named_pod_must_be_on_loopback_and_no_proof_is_given() -> None:
    keyless = HandoffAuth(key=None)
    assert keyless.identity_proof(nonce="abc", role="prefill", endpoint="127.0.0.1:8000") is None
    keyless.check_identity(endpoint="127.0.0.5:8000", nonce="abc", role="prefill", proof=None)
    with pytest.raises(HandoffRejected) as refusal:
        keyless.check_identity(endpoint="10.0.0.7:8000", nonce="abc", role="prefill", proof=None)
    assert refusal.value.code == "endpoint_not_allowed"
    # a nonce no asker of ours sends gets no proof
    assert HandoffAuth(key=KEY).identity_proof(nonce="x" * 65, role="prefill", endpoint="10.0.0.7:8000") is None
    assert HandoffAuth(key=KEY).identity_proof(nonce="a\nb", role="prefill", endpoint="10.0.0.7:8000") is None
