"""Handoff parameters come only from our own prefill pods (issue 12, defect 4), with real
processes: a prefill pod, a decode pod and a router sharing one handoff key, as the operator
deploys them.

- Parameters a client forges (unsigned, a made-up or foreign signature, altered, expired,
  another pool's compat hash) sent straight to the decode pod are a 403, and the decode pod
  never connects to the endpoint they name: a listening socket sees no connection (while a
  correctly signed handoff to the same socket does reach it, so the socket would have seen one).
- Through the router, a client's ``kv_transfer_params`` are dropped on every route.
- A KV puller without the key gets one ERROR frame from the prefill pod and nothing else, and
  the export stays for the real decode pod, which then pulls it.
- The signed parameters bind the prompt (the cross-user prefix-cache poisoning defect): a real
  prefill pod's parameters for prompt A presented with a prompt B of the same length are a 403
  (``prompt_mismatch``) before any pull, and B is then served from B's own tokens (nothing
  cached under B's block hashes), as by a decode pod that never saw the attempt.
- Through the router, a decode pod refusing the parameters the router brought (another prompt's,
  a first token outside the vocabulary, a length off by one) costs the client nothing: the
  decode pod computes the prompt itself (route "fallback").
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from disagg_harness import MODEL_NAME, Cluster, Proc, Reference, wait_for

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric
from splitserve_contract.block_hash import prompt_digest
from splitserve_e2e.net import free_port
from splitserve_runtime.transfer import HandoffAuth, HandoffKey, framing
from splitserve_runtime.transfer.framing import FrameType

PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(
        model_dir=model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        num_prefill=1,
        num_decode=1,
        health_interval_seconds=30.0,
    ) as running:
        yield running


class Listener:
    """A TCP port that counts the connections made to it and closes each at once."""

    def __init__(self, host: str = "127.0.0.97") -> None:
        self._sock = socket.create_server((host, free_port(host)))
        self._sock.settimeout(0.1)
        self.endpoint = f"{host}:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def _post(pod: Proc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{pod.url}/v1/completions", timeout=60, json=body)


def _body(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0, **extra}


def test_forged_handoff_params_are_refused_without_any_connection(cluster: Cluster, reference: Reference) -> None:
    decode, prefill = cluster.decode[0], cluster.prefill[0]
    token_ids = reference.tokenizer.encode(PROMPT)
    with Listener() as listener:
        base = {
            "remote_endpoint": listener.endpoint,
            "remote_request_id": "cmpl-probe",
            "num_prompt_tokens": len(token_ids),
            "first_token_id": 5,
            "compat_hash": "tinyhash",
            "prompt_digest": prompt_digest(token_ids),
        }
        stranger = HandoffAuth(key=HandoffKey(b"a key of some other InferenceService"))
        genuine_elsewhere = cluster.sign({**base, "remote_endpoint": f"{prefill.host}:{prefill.kv_port}"})
        forged = {
            "unsigned": base,
            "made-up signature": {**base, "expires_at": 4_000_000_000, "signature": "0" * 64},
            "signed with another key": stranger.sign(base, lifetime_seconds=30),
            "endpoint altered after signing": {**genuine_elsewhere, "remote_endpoint": listener.endpoint},
            "expired": cluster.sign(base, lifetime_seconds=-3600),
            "another pool's compat hash": cluster.sign({**base, "compat_hash": "otherhash"}),
        }
        for case, params in forged.items():
            for stream in (False, True):
                response = _post(decode, _body(PROMPT, stream=stream, **{KV_TRANSFER_PARAMS_FIELD: params}))
                assert response.status_code == 403, (case, response.text)
                error = response.json()["error"]
                assert error["code"] == "kv_transfer_params_rejected", (case, error)
                assert error["param"] == KV_TRANSFER_PARAMS_FIELD
        assert listener.connections == 0
        # the control: the same endpoint, signed by the pool's key, is connected to (the pull
        # fails on the closed connection and the decode pod computes the prompt itself; then it
        # connects once more, to RELEASE the export a cut-off pull leaves pinned there)
        response = _post(decode, _body(PROMPT, **{KV_TRANSFER_PARAMS_FIELD: cluster.sign(base)}))
        assert response.status_code == 200, response.text
        wait_for(lambda: listener.connections == 2, timeout_seconds=5, what="the pull, then the release")
    assert decode.ready()


def test_the_router_drops_a_clients_kv_transfer_params(cluster: Cluster, reference: Reference) -> None:
    router = cluster.router
    assert router is not None
    decode = cluster.decode[0]
    with Listener() as listener:
        for prompt, route in ((PROMPT, "disaggregated"), ("Hi", "direct")):
            num_prompt = len(reference.tokenizer.encode(prompt))
            # even correctly signed ones: only the prefill pod the router chose may hand over
            params = cluster.sign(
                {
                    "remote_endpoint": listener.endpoint,
                    "remote_request_id": "cmpl-c",
                    "num_prompt_tokens": num_prompt,
                    "first_token_id": 5,
                    "compat_hash": "tinyhash",
                }
            )
            want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=6, ignore_eos=True)
            routed = router.metric("splitserve_router_routes_total", route=route)
            received = decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL)
            response = httpx.post(
                f"{cluster.router_url}/completions",
                timeout=60,
                json=_body(prompt, **{KV_TRANSFER_PARAMS_FIELD: params}),
            )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == want
            assert router.metric("splitserve_router_routes_total", route=route) == routed + 1
            if route == "disaggregated":  # the real, signed handoff of our prefill pod worked
                assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) > received
        assert listener.connections == 0


async def test_a_kv_puller_without_the_key_gets_nothing_and_the_real_one_pulls(
    cluster: Cluster, reference: Reference
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    body = _body(f"{PROMPT} (pulled)")
    async with httpx.AsyncClient(timeout=60) as http:
        handoff = await http.post(
            f"{prefill.url}/v1/completions",
            json={**body, "max_tokens": 1, KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True}},
        )
        assert handoff.status_code == 200, handoff.text
        params = handoff.json()[KV_TRANSFER_PARAMS_FIELD]
        assert params["signature"] and params["expires_at"]
        layout = {
            "num_layers": 2,
            "block_size": 16,
            "num_kv_heads": 2,
            "head_dim": 16,
            "dtype": "float32",
            "dtype_bytes": 4,
            "compat_hash": "tinyhash",
        }
        for credentials in (
            {},
            {"nonce": "n1", "token": "f" * 64},
            HandoffAuth(key=HandoffKey(b"guessed-guessed-guessed")).fetch_credentials(
                request_id=params["remote_request_id"], nonce="n2"
            ),
        ):
            reader, writer = await asyncio.open_connection(prefill.host, prefill.kv_port)
            writer.write(
                framing.encode_json(
                    FrameType.FETCH,
                    {"request_id": params["remote_request_id"], "first_block": 0, "layout": layout, **credentials},
                )
            )
            await writer.drain()
            frame = await framing.read_frame(reader, timeout_seconds=5, max_payload_bytes=1 << 16)
            assert frame.type is FrameType.ERROR and frame.json()["code"] == "unauthorized"
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # no LAYOUT, no BLOCK
            writer.close()
        want, _ = await asyncio.to_thread(
            reference.generate, reference.tokenizer.encode(body["prompt"]), max_tokens=6, ignore_eos=True
        )
        received = await asyncio.to_thread(decode.metric, Metric.KV_TRANSFER_BYTES_TOTAL)
        answer = await http.post(f"{decode.url}/v1/completions", json={**body, KV_TRANSFER_PARAMS_FIELD: params})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want
        assert await asyncio.to_thread(decode.metric, Metric.KV_TRANSFER_BYTES_TOTAL) > received
    refused = prefill.log_tail(num_chars=1_000_000).count("(unauthorized)")
    assert refused == 3, prefill.log_tail()


# --------------------------------------------------------------------------- the prompt binding
NUM_BINDING_TOKENS = 96
"""Six full blocks of 16: what a poisoned prefix cache would have served as cached."""


def _token_prompt(reference: Reference, seed: int) -> list[int]:
    """A prompt of token ids no other test sends (so nothing of it is cached beforehand)."""
    rng = random.Random(seed)
    return [rng.randrange(10, reference.engine.vocab_size) for _ in range(NUM_BINDING_TOKENS)]


def _prefill_params(prefill: Proc, prompt: list[int]) -> dict[str, Any]:
    """The signed handoff parameters a real prefill pod answers for ``prompt``."""
    answer = _post(prefill, _body(prompt, max_tokens=1, **{KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True}}))
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()[KV_TRANSFER_PARAMS_FIELD]
    assert params["num_prompt_tokens"] == NUM_BINDING_TOKENS and params["prompt_digest"]
    return params


def _cached_tokens(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_params_of_another_prompt_are_refused_and_poison_no_cache(cluster: Cluster, reference: Reference) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt_a, prompt_b = _token_prompt(reference, seed=1), _token_prompt(reference, seed=2)
    want_a, _ = reference.generate(prompt_a, max_tokens=6, ignore_eos=True)
    want_b, _ = reference.generate(prompt_b, max_tokens=6, ignore_eos=True)
    assert want_a != want_b  # else a poisoned answer could not be told from B's own
    params_a = _prefill_params(prefill, prompt_a)
    received = decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL)
    for stream in (False, True):  # A's genuine, signed parameters with B: refused before any pull
        answer = _post(decode, _body(prompt_b, stream=stream, **{KV_TRANSFER_PARAMS_FIELD: params_a}))
        assert answer.status_code == 403, answer.text
        error = answer.json()["error"]
        assert error["code"] == "kv_transfer_params_rejected" and error["param"] == KV_TRANSFER_PARAMS_FIELD
        assert "prompt_mismatch" in error["message"], error
    assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) == received  # no KV was pulled
    # B as any later user sends it: computed from B's own tokens, nothing of A's KV under B's hashes
    answer = _post(decode, _body(prompt_b))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want_b
    assert _cached_tokens(answer) == 0
    again = _post(decode, _body(prompt_b))  # and now B's own blocks are what is cached
    assert again.json()["choices"][0]["text"] == want_b
    assert _cached_tokens(again) == (NUM_BINDING_TOKENS - 1) // 16 * 16  # the last token is computed
    # the refusals left A's export for its real decode: A with its own parameters pulls it
    answer = _post(decode, _body(prompt_a, **{KV_TRANSFER_PARAMS_FIELD: params_a}))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want_a
    assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) > received


class _SkewedPrefill:
    """A "prefill pod" in front of the real one, for a router: GETs (ready, info, metrics) are
    the real pod's; a prefill request goes to the real pod as ``rewrite`` changes it, and its
    answer's handoff parameters come back as ``edit`` changes them (re-signed with the pool's
    key, as a prefill pod with another tokenizer or a bug would sign them)."""

    def __init__(self, *, cluster: Cluster, host: str = "127.0.0.33") -> None:
        self.real = cluster.prefill[0]
        self.rewrite: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: body
        self.edit: Callable[[dict[str, Any]], dict[str, Any]] = lambda params: params
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                real = httpx.get(f"{outer.real.url}{self.path}", timeout=10)
                self._answer(real.status_code, real.content, real.headers.get("content-type", "text/plain"))

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                real = httpx.post(f"{outer.real.url}{self.path}", json=outer.rewrite(body), timeout=60)
                answer = real.json()
                if real.status_code == 200:
                    answer[KV_TRANSFER_PARAMS_FIELD] = cluster.sign(outer.edit(answer[KV_TRANSFER_PARAMS_FIELD]))
                self._answer(real.status_code, json.dumps(answer).encode(), "application/json")

            def _answer(self, status: int, content: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
                pass

        self._server = ThreadingHTTPServer((host, free_port(host)), Handler)
        self.endpoint = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> _SkewedPrefill:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_the_router_computes_on_decode_when_decode_refuses_its_handoff(cluster: Cluster, reference: Reference) -> None:
    decode = cluster.decode[0]
    with _SkewedPrefill(cluster=cluster) as skewed:
        router = cluster.router_proc(policy="RoundRobin", octet=60)
        router.argv[router.argv.index("--prefill-endpoints") + 1] = skewed.endpoint
        cluster.start_router(router)
        cases: dict[
            str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[dict[str, Any]], dict[str, Any]]]
        ] = {
            "another prompt of the same length": (
                lambda body: {**body, "prompt": _token_prompt(reference, seed=3)},
                lambda params: params,
            ),
            "a first token outside the vocabulary": (
                lambda body: body,
                lambda params: {**params, "first_token_id": reference.engine.vocab_size},
            ),
            "a prompt length off by one": (
                lambda body: body,
                lambda params: {**params, "num_prompt_tokens": params["num_prompt_tokens"] + 1},
            ),
        }
        for index, (case, (rewrite, edit)) in enumerate(cases.items()):
            skewed.rewrite, skewed.edit = rewrite, edit
            prompt = _token_prompt(reference, seed=10 + index)
            want, _ = reference.generate(prompt, max_tokens=6, ignore_eos=True)
            for stream in (False, True):
                fallbacks = router.metric("splitserve_router_routes_total", route="fallback")
                received = decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL)
                response = httpx.post(f"{router.url}/v1/completions", timeout=60, json=_body(prompt, stream=stream))
                assert response.status_code == 200, (case, response.text)
                if stream:
                    chunks = [
                        json.loads(line.removeprefix("data: "))
                        for line in response.text.splitlines()
                        if line.startswith("data: ") and line != "data: [DONE]"
                    ]
                    assert all("error" not in chunk for chunk in chunks), (case, chunks)
                    text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
                else:
                    text = response.json()["choices"][0]["text"]
                assert text == want, case
                assert router.metric("splitserve_router_routes_total", route="fallback") == fallbacks + 1, case
                assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) == received, case  # nothing pulled
