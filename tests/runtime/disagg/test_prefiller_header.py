"""A decode pod behind a Gateway API Inference Extension endpoint picker: the picker names the
prefill pod in ``x-prefiller-host-port`` (or ``x-gateway-prefill-endpoints``) and the decode pod
drives the prefill and the KV pull itself, with no router in the path. Real processes on
loopback (a prefill and a decode pod of the tiny model, with a handoff key): the answers must
equal the aggregated engine's, the KV must really come from the named pod (its transfer counter
moves), a malformed header is a 400 in the OpenAI error shape, a named address gets the request
(and the client's key) only once it proved it is a prefill pod of this InferenceService at that
address, and a named pod that cannot hand over (unreachable, a stranger, a relay, or answering
with parameters the decode pod refuses) costs the client nothing but a prompt computed on the
decode pod, counted as a failed transfer."""

from __future__ import annotations

import contextlib
import json
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlparse

import httpx
import openai
import pytest
from disagg_harness import MODEL_NAME, Cluster, Proc, Reference
from openai.types.chat import ChatCompletionMessageParam
from starlette.datastructures import Headers
from starlette.requests import Request

from splitserve_contract import INFO_PATH, KV_TRANSFER_PARAMS_FIELD, Metric, Role
from splitserve_e2e.net import free_port
from splitserve_runtime.disagg.prefiller import (
    PREFILL_ENDPOINTS_HEADER,
    PREFILLER_HEADER,
    prefill_endpoints,
)
from splitserve_runtime.disagg.routes import HandoffRouteError
from splitserve_runtime.server.serving_common import named_prefill_endpoints
from splitserve_runtime.server.state import ServerState
from splitserve_runtime.transfer.auth import HandoffAuth, HandoffKey

STORY = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)


@pytest.fixture(scope="module")
def pods(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=1,
        num_decode=1,
        health_interval_seconds=30.0,
        decode_overrides={"prefill_headers": True},
    ) as running:
        yield running


def _decode(pods: Cluster) -> Proc:
    return pods.decode[0]


def _prefill(pods: Cluster) -> Proc:
    return pods.prefill[0]


def _client(pods: Cluster, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{_decode(pods).url}/v1", api_key="unused", max_retries=0, timeout=60, default_headers=headers
    )


def _exported(pods: Cluster) -> float:
    return float(_prefill(pods).metric(Metric.KV_TRANSFER_BYTES_TOTAL))


def _failures(pods: Cluster) -> float:
    return float(_decode(pods).metric(Metric.KV_TRANSFER_FAILURES_TOTAL))


def _prefilled(pods: Cluster) -> float:
    return float(_prefill(pods).metric(Metric.REQUESTS_TOTAL, outcome="success"))


def _complete(client: openai.OpenAI, prompt: str, *, stream: bool) -> str:
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=20,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks if c.choices)
    answer = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 20
    return answer.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_named_prefill_pod_prefills_and_decode_pulls_its_kv(pods: Cluster, reference: Reference, stream: bool) -> None:
    prompt = f"{STORY} ({'streamed' if stream else 'whole'}, named prefill pod)"
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=20, ignore_eos=True)
    exported, failures, prefilled = _exported(pods), _failures(pods), _prefilled(pods)
    got = _complete(_client(pods, **{PREFILLER_HEADER: _prefill(pods).endpoint}), prompt, stream=stream)
    assert got == want
    # The named pod computed the prompt (one request) and its KV went to the decode pod.
    assert _prefilled(pods) == prefilled + 1
    assert _exported(pods) > exported
    assert _failures(pods) == failures


def test_chat_through_the_proposed_list_header_takes_the_first_pod_that_answers(
    pods: Cluster, reference: Reference
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a careful assistant who answers briefly."},
        {"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea."},
    ]
    want, _ = reference.generate(reference.chat_prompt([dict(m) for m in messages]), max_tokens=16)
    nobody = f"127.0.0.30:{free_port('127.0.0.30')}"  # nothing listens there
    exported, failures = _exported(pods), _failures(pods)
    client = _client(pods, **{PREFILL_ENDPOINTS_HEADER: f"{nobody}, {_prefill(pods).endpoint}"})
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert answer.choices[0].message.content == want
    assert _exported(pods) > exported
    assert _failures(pods) == failures  # the second pod handed over: no fallback


@pytest.mark.parametrize(
    "value",
    [
        "10.0.0.1",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        "10.0.0.1:http",
        ":8000",
        "bad host:8000",
        "[::1:8000",
        "[zz::1]:8000",
        "-x.example:8000",
        "10.0.0.1:8000/v1",
    ],
)
def test_malformed_prefiller_header_is_a_400(pods: Cluster, value: str) -> None:
    response = httpx.post(
        f"{_decode(pods).url}/v1/completions",
        headers={PREFILLER_HEADER: value},
        json={"model": MODEL_NAME, "prompt": STORY, "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_prefill_endpoint"
    assert PREFILLER_HEADER in error["message"]


def test_malformed_list_and_conflicting_params_are_400s(pods: Cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": STORY, "max_tokens": 2}
    url = f"{_decode(pods).url}/v1/completions"
    endpoint = _prefill(pods).endpoint
    too_many = ",".join(f"127.0.0.{i}:8000" for i in range(40, 50))
    for headers, json_body in [
        ({PREFILL_ENDPOINTS_HEADER: f"{endpoint},,"}, body),
        ({PREFILL_ENDPOINTS_HEADER: ""}, body),
        ({PREFILL_ENDPOINTS_HEADER: too_many}, body),
        ({PREFILLER_HEADER: endpoint}, {**body, KV_TRANSFER_PARAMS_FIELD: {"remote_endpoint": "127.0.0.1:1"}}),
    ]:
        response = httpx.post(url, headers=headers, json=json_body, timeout=30)
        assert response.status_code == 400, (headers, response.text)
        assert response.json()["error"]["code"] == "invalid_prefill_endpoint"


def test_unreachable_prefill_pod_is_replaced_by_a_local_prefill(pods: Cluster, reference: Reference) -> None:
    prompt = f"{STORY} (nobody answers)"
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=20, ignore_eos=True)
    exported, failures, prefilled = _exported(pods), _failures(pods), _prefilled(pods)
    nobody = f"127.0.0.31:{free_port('127.0.0.31')}"
    assert _complete(_client(pods, **{PREFILLER_HEADER: nobody}), prompt, stream=False) == want
    assert _failures(pods) == failures + 1
    assert (_exported(pods), _prefilled(pods)) == (exported, prefilled)


class _NamedPod(BaseHTTPRequestHandler):
    """A pod a header names. Records every request it gets (method, path, headers, body); GETs
    go to ``serve_get``, POSTs to ``serve_post`` (set by each test's subclass)."""

    seen: list[tuple[str, str, dict[str, str], dict[str, Any] | None]]

    def _record(self, body: dict[str, Any] | None) -> None:
        type(self).seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._record(None)
        status, answer = self.serve_get()
        self._answer(status, answer)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self._record(body)
        status, answer = self.serve_post(body)
        self._answer(status, answer)

    def serve_get(self) -> tuple[int, bytes]:
        return 404, b"{}"

    def serve_post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        return 404, b"{}"

    def _answer(self, status: int, answer: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


@contextlib.contextmanager
def _named_pod(handler: type[_NamedPod], host: str) -> Iterator[str]:
    handler.seen = []
    server = ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _forged_params() -> bytes:
    return json.dumps(
        {
            "choices": [{"text": "x"}],
            KV_TRANSFER_PARAMS_FIELD: {
                "remote_endpoint": "127.0.0.1:1",
                "remote_request_id": "forged",
                "num_prompt_tokens": 3,
                "first_token_id": 1,
                "compat_hash": "tinyhash",
                "expires_at": 4_000_000_000,
                "signature": "00" * 32,
            },
        }
    ).encode()


class _Stranger(_NamedPod):
    """An address a client named itself, without the handoff key: it would answer any prefill
    request with parameters it could not sign, and keeps whatever credentials it is sent."""

    def serve_get(self) -> tuple[int, bytes]:
        return 200, json.dumps({"identity_proof": "00" * 32}).encode()

    def serve_post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        return 200, _forged_params()


def test_a_named_address_without_the_key_gets_neither_the_request_nor_the_clients_key(
    pods: Cluster, reference: Reference
) -> None:
    """A client that reaches a decode pod can name any address in the header: the decode pod
    asks it to prove it is a prefill pod of this InferenceService first, and sends it neither
    the request nor the client's Authorization when it cannot."""
    prompt = f"{STORY} (a stranger is named)"
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=20, ignore_eos=True)
    failures = _failures(pods)
    with _named_pod(_Stranger, "127.0.0.32") as endpoint:
        client = _client(pods, **{PREFILLER_HEADER: endpoint, "authorization": "Bearer client-key"})
        assert _complete(client, prompt, stream=True) == want
    assert _failures(pods) == failures + 1
    assert [(method, path.partition("?")[0]) for method, path, _, _ in _Stranger.seen] == [("GET", INFO_PATH)]
    _, path, headers, _ = _Stranger.seen[0]
    assert "nonce=" in path and "authorization" not in headers


class _Relay(_NamedPod):
    """A stranger that passes the identity question on to the real prefill pod (whose pod-info
    route is open) and its answer back: the proof names the real pod's address, not the relay's."""

    real_url = ""

    def serve_get(self) -> tuple[int, bytes]:
        real = httpx.get(f"{type(self).real_url}{self.path}", timeout=30)
        return real.status_code, real.content

    def serve_post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        return 200, _forged_params()


def test_a_relay_of_a_real_prefill_pods_proof_gets_nothing(pods: Cluster, reference: Reference) -> None:
    _Relay.real_url = _prefill(pods).url
    prompt = f"{STORY} (a relay is named)"
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=20, ignore_eos=True)
    failures = _failures(pods)
    with _named_pod(_Relay, "127.0.0.33") as endpoint:
        client = _client(pods, **{PREFILLER_HEADER: endpoint, "authorization": "Bearer client-key"})
        assert _complete(client, prompt, stream=False) == want
    assert _failures(pods) == failures + 1
    assert [method for method, _, _, _ in _Relay.seen] == ["GET"]  # the proof was relayed, and refused
    assert "did not prove" in _decode(pods).log_tail(num_chars=200_000)


class _KeyedPod(_NamedPod):
    """A pod of this InferenceService (it holds the handoff key and proves so for its own
    address) that prefills on the real prefill pod: either the request as sent, or another
    prompt of the same length (as a pod with another tokenizer, or a bug, would), answering
    with the real pod's genuine, signed parameters."""

    real_url = ""
    key: bytes = b""
    address = ""
    other_prompt: list[int] | None = None

    def serve_get(self) -> tuple[int, bytes]:
        nonce = parse_qs(urlparse(self.path).query)["nonce"][0]
        proof = HandoffAuth(key=HandoffKey(type(self).key)).identity_proof(
            nonce=nonce, role=Role.PREFILL.value, endpoint=type(self).address
        )
        return 200, json.dumps({"identity_proof": proof}).encode()

    def serve_post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        other = type(self).other_prompt
        sent = body if other is None else {**body, "prompt": other}
        real = httpx.post(f"{type(self).real_url}{self.path}", json=sent, timeout=60)
        return real.status_code, real.content


@contextlib.contextmanager
def _keyed_pod(pods: Cluster, host: str, *, other_prompt: list[int] | None) -> Iterator[str]:
    assert pods.handoff_key is not None
    _KeyedPod.real_url, _KeyedPod.key, _KeyedPod.other_prompt = (_prefill(pods).url, pods.handoff_key, other_prompt)
    with _named_pod(_KeyedPod, host) as endpoint:
        _KeyedPod.address = endpoint
        yield endpoint


def test_a_pod_that_proves_it_holds_the_key_gets_the_prefill_request(pods: Cluster, reference: Reference) -> None:
    prompt = f"{STORY} (a keyed pod is named)"
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=20, ignore_eos=True)
    with _keyed_pod(pods, "127.0.0.35", other_prompt=None) as endpoint:
        client = _client(pods, **{PREFILLER_HEADER: endpoint, "authorization": "Bearer client-key"})
        assert _complete(client, prompt, stream=False) == want
    # What the named pod was sent: the client's request as the router's prefill request.
    method, _, headers, sent = _KeyedPod.seen[-1]
    assert method == "POST" and sent is not None and headers["authorization"] == "Bearer client-key"
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["prompt"] == prompt
    assert sent[KV_TRANSFER_PARAMS_FIELD] == {"do_remote_decode": True} and "stream_options" not in sent


def test_parameters_for_another_prompt_are_replaced_by_a_local_prefill(pods: Cluster, reference: Reference) -> None:
    """The prompt binding on this path (the prefix-cache poisoning defect): the decode pod
    refuses the named pod's parameters for a prompt of the same length but other tokens before
    any pull, computes the request's own prompt, and caches nothing of the other prompt's KV."""
    prompt = [(7 * i + 11) % 500 + 10 for i in range(48)]
    want, _ = reference.generate(prompt, max_tokens=20, ignore_eos=True)
    other = [(13 * i + 5) % 500 + 10 for i in range(48)]
    with _keyed_pod(pods, "127.0.0.34", other_prompt=other) as endpoint:
        failures, received = _failures(pods), _decode(pods).metric(Metric.KV_TRANSFER_BYTES_TOTAL)
        client = _client(pods, **{PREFILLER_HEADER: endpoint})
        answer = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.choices[0].text == want
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        assert _failures(pods) == failures + 1
        assert _decode(pods).metric(Metric.KV_TRANSFER_BYTES_TOTAL) == received  # nothing pulled
    warnings = _decode(pods).log_tail(num_chars=200_000)
    assert "prompt_mismatch" in warnings, warnings[-2000:]


def test_only_decode_pods_read_the_headers() -> None:
    headers = Headers({PREFILLER_HEADER: "10.0.0.7:8000", PREFILL_ENDPOINTS_HEADER: "10.0.0.8:8000,10.0.0.7:8000"})
    assert prefill_endpoints(headers, role=Role.DECODE.value, has_kv_transfer_params=False) == (
        "10.0.0.7:8000",
        "10.0.0.8:8000",
    )
    for role in (Role.AGGREGATED, Role.PREFILL):
        assert prefill_endpoints(headers, role=role.value, has_kv_transfer_params=False) == ()
    assert prefill_endpoints(Headers({}), role=Role.DECODE.value, has_kv_transfer_params=True) == ()
    assert prefill_endpoints(
        Headers({PREFILLER_HEADER: "[FD00::1]:8000"}), role=Role.DECODE.value, has_kv_transfer_params=False
    ) == ("[fd00::1]:8000",)
    with pytest.raises(HandoffRouteError) as refused:
        prefill_endpoints(
            Headers(raw=[(PREFILLER_HEADER.encode(), b"10.0.0.7:8000")] * 2),
            role=Role.DECODE.value,
            has_kv_transfer_params=False,
        )
    assert refused.value.status_code == 400


def test_the_headers_mean_nothing_without_prefill_headers() -> None:
    """A pod not started with ``--prefill-headers`` (every pod but the decode pods of an
    InferencePool-mode service) ignores them: a client cannot make it send its request to an
    address of the client's choosing."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(PREFILLER_HEADER.encode(), b"10.0.0.7:8000")],
    }
    body = cast(Any, types.SimpleNamespace(kv_transfer_params=None))
    for enabled, expected in ((False, ()), (True, ("10.0.0.7:8000",))):
        state = ServerState(served_model_name=MODEL_NAME, role=Role.DECODE.value, prefill_headers=enabled)
        assert named_prefill_endpoints(state=state, request=Request(scope), body=body) == expected
