"""Disaggregated serving end to end: the `openai` client -> router -> prefill pod -> KV over TCP
-> decode pod, all real processes on loopback. Greedy answers must equal the aggregated engine's
(completions and chat, streamed and not); affinity and sessions must pin prompts to prefill pods
(visible in metrics); broken or missing KV must leak no block and fall back to computing the
prompt on the decode pod (same answer); a
killed prefill pod costs one retry, a decode pod killed mid-stream a clean error in bounded time.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from disagg_harness import BLOCK_SIZE, MODEL_NAME, Cluster, Proc, Reference, wait_for
from openai.types.chat import ChatCompletionMessageParam

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric
from splitserve_contract.block_hash import prompt_digest
from splitserve_runtime.model.tokenizer import Tokenizer
from splitserve_runtime.transfer.framing import (
    HEADER,
    MAGIC,
    VERSION,
    FrameType,
    encode_json,
    read_frame,
)

KV_TTL_SECONDS = 3.0
STORY = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)
SYSTEM = (
    "You are a careful assistant. Answer briefly, cite your sources, and never invent "
    "facts. If you do not know, say so plainly and suggest where to look instead."
)


def _cluster(model_dir: Path, log_dir: Path) -> Cluster:
    return Cluster(
        model_dir=model_dir,
        log_dir=log_dir,
        num_prefill=2,
        num_decode=2,
        kv_ttl_seconds=KV_TTL_SECONDS,
        health_interval_seconds=30.0,
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Shared by the tests that leave every pod running."""
    with _cluster(model_dir, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture
def own_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster for one test that kills its pods (so the order of tests does not matter)."""
    with _cluster(model_dir, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return _client(cluster)


def _total(pods: list[Proc], name: str, **labels: str) -> float:
    return float(sum(p.metric(name, **labels) for p in pods))


def _decode_idle(cluster: Cluster) -> bool:
    return all(p.metric(Metric.KV_CACHE_USAGE_RATIO) == 0.0 for p in cluster.decode)


def test_info_reports_role_and_kv_endpoint(cluster: Cluster) -> None:
    for pod in cluster.pods:
        info = httpx.get(f"{pod.url}/v1/splitserve/info", timeout=5).json()
        assert info["role"] == pod.name.split("-")[0]
        assert info["kv_endpoint"] == f"{pod.host}:{pod.kv_port}"
        assert info["compat_hash"] == "tinyhash" and info["block_size"] == BLOCK_SIZE


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_aggregated(
    cluster: Cluster, client: openai.OpenAI, reference: Reference, stream: bool
) -> None:
    prompt = f"{STORY} ({'streamed' if stream else 'whole'})"
    want_text, want_tokens = reference.generate(reference.tokenizer.encode(prompt), max_tokens=24, ignore_eos=True)
    routed = cluster.router.metric("splitserve_router_routes_total", route="disaggregated")
    received = _total(cluster.decode, Metric.KV_TRANSFER_BYTES_TOTAL)
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        answer = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        text = answer.choices[0].text
        assert answer.usage is not None and answer.usage.completion_tokens == len(want_tokens) == 24
        assert answer.choices[0].finish_reason == "length"
    assert text == want_text
    # it really went prefill -> KV transfer -> decode
    assert cluster.router.metric("splitserve_router_routes_total", route="disaggregated") == routed + 1
    assert _total(cluster.decode, Metric.KV_TRANSFER_BYTES_TOTAL) > received


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_aggregated(cluster: Cluster, client: openai.OpenAI, reference: Reference, stream: bool) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Tell me a story about a {'river' if stream else 'hill'}."},
    ]
    want_text, _ = reference.generate(reference.chat_prompt([dict(m) for m in messages]), max_tokens=20)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
        text = answer.choices[0].message.content or ""
    assert text == want_text


async def test_concurrent_requests_equal_aggregated(cluster: Cluster, reference: Reference) -> None:
    """Imports landing while other requests decode on the same pods change no answer."""
    prompts = [f"{STORY}, chapter {i}" for i in range(6)]
    wanted = [reference.generate(reference.tokenizer.encode(p), max_tokens=16, ignore_eos=True)[0] for p in prompts]
    client = openai.AsyncOpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0, timeout=60)

    async def one(prompt: str, stream: bool) -> str:
        if stream:
            chunks = await client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])
        answer = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        return answer.choices[0].text

    got = await asyncio.gather(*(one(p, i % 2 == 0) for i, p in enumerate(prompts)))
    await client.close()
    assert list(got) == wanted
    await asyncio.to_thread(
        wait_for, lambda: _decode_idle(cluster), timeout_seconds=5, what="decode KV usage back to 0"
    )


def test_seeded_sampling_equals_aggregated(client: openai.OpenAI, reference: Reference) -> None:
    want_text, _ = reference.generate(
        reference.tokenizer.encode(STORY), max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True
    )
    answer = client.completions.create(
        model=MODEL_NAME, prompt=STORY, max_tokens=16, temperature=0.9, seed=1234, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want_text


def test_one_token_answer_comes_from_prefill_and_frees_its_kv_at_once(
    cluster: Cluster, client: openai.OpenAI, reference: Reference
) -> None:
    """max_tokens=1: the prefill pod's first token is the whole answer; the decode pod pulls
    nothing but RELEASEs, so the prefill pod frees the blocks long before the lease would."""
    prompt = f"{STORY} in one word"
    want_text, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=1, ignore_eos=True)
    answer = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want_text and answer.choices[0].finish_reason == "length"
    wait_for(
        lambda: all(p.metric(Metric.KV_CACHE_USAGE_RATIO) == 0.0 for p in cluster.prefill),
        timeout_seconds=KV_TTL_SECONDS / 2,
        what="the prefill pods to free the KV",
    )


def test_short_prompt_goes_straight_to_decode(cluster: Cluster, client: openai.OpenAI, reference: Reference) -> None:
    direct = cluster.router.metric("splitserve_router_routes_total", route="direct")
    want_text, _ = reference.generate(reference.tokenizer.encode("Hi"), max_tokens=8, ignore_eos=True)
    answer = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want_text
    assert cluster.router.metric("splitserve_router_routes_total", route="direct") == direct + 1


def _served(cluster: Cluster) -> list[float]:
    return [p.metric(Metric.REQUESTS_TOTAL, outcome="success") for p in cluster.prefill]


def test_prefix_affinity_pins_a_shared_prefix_and_hits_the_cache(cluster: Cluster, client: openai.OpenAI) -> None:
    router = cluster.router
    assert router is not None
    before = _served(cluster)
    hits = [p.metric(Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL) for p in cluster.prefill]
    matched = router.metric("splitserve_router_prefix_matched_blocks_total")
    prefix = f"{SYSTEM} {SYSTEM}"
    num_prefix_blocks = len(cluster_tokenizer(cluster).encode(prefix)) // BLOCK_SIZE
    for question in ("Why is the sky blue?", "What is a prime?", "Who wrote Hamlet?", "How do bees fly?"):
        client.completions.create(model=MODEL_NAME, prompt=f"{prefix} {question}", max_tokens=2, temperature=0)
    served = [after - b for after, b in zip(_served(cluster), before, strict=True)]
    assert sorted(served) == [0, 4], served  # every request on one prefill pod
    pod = served.index(4)
    # three of the four found the shared prefix already cached there
    hit_tokens = cluster.prefill[pod].metric(Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL) - hits[pod]
    assert hit_tokens >= 3 * (num_prefix_blocks - 1) * BLOCK_SIZE
    assert router.metric("splitserve_router_prefix_matched_blocks_total") - matched >= 3 * (num_prefix_blocks - 1)


def cluster_tokenizer(cluster: Cluster) -> Tokenizer:
    return Tokenizer.from_dir(model_dir=cluster.model_dir)


def test_session_header_pins_distinct_prompts_to_one_pod(cluster: Cluster, client: openai.OpenAI) -> None:
    # find two prompts that affinity alone sends to different prefill pods
    placed: dict[int, str] = {}
    for i in range(12):
        prompt = f"Session probe number {i}: {STORY} {i * 7919}"
        before = _served(cluster)
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
        pod = next(j for j, (a, b) in enumerate(zip(_served(cluster), before, strict=True)) if a > b)
        placed.setdefault(pod, prompt)
        if len(placed) == 2:
            break
    assert len(placed) == 2, "every probe landed on one pod"
    before = _served(cluster)
    for prompt in (placed[0], placed[1], placed[0], placed[1]):
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, extra_headers={"x-session-id": "chat-42"}
        )
    served = [after - b for after, b in zip(_served(cluster), before, strict=True)]
    assert sorted(served) == [0, 4], served


# --------------------------------------------------------------------------- broken KV


class FakePrefillKV:
    """A prefill pod's KV port that answers FETCH with a corrupt or truncated block. It holds
    the cluster's handoff key (a buggy pod of ours, not a stranger: a stranger's LAYOUT is
    refused before any block, see test_disagg_handoff_auth.py)."""

    def __init__(self, *, mode: str, cluster: Cluster) -> None:
        from splitserve_runtime.transfer.auth import HandoffAuth, HandoffKey

        assert cluster.handoff_key is not None
        self._auth = HandoffAuth(key=HandoffKey(cluster.handoff_key))
        self.mode = mode
        self.fetches: list[dict[str, object]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakePrefillKV:
        self._server = await asyncio.start_server(self._serve, "127.0.0.99", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"127.0.0.99:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            fetch = (await read_frame(reader, timeout_seconds=5, max_payload_bytes=1 << 16)).json()
            self.fetches.append(fetch)
            layout = fetch["layout"]
            block_nbytes = (
                2
                * layout["num_layers"]
                * layout["block_size"]
                * layout["num_kv_heads"]
                * layout["head_dim"]
                * layout["dtype_bytes"]
            )
            num_tokens = int(self.mode.split(":")[1])
            header = {
                "num_blocks": math.ceil(num_tokens / BLOCK_SIZE),
                "num_tokens": num_tokens,
                "first_block": fetch["first_block"],
                "block_nbytes": block_nbytes,
            }
            proof = self._auth.layout_proof(
                request_id=str(fetch["request_id"]), nonce=str(fetch["nonce"]), header=header
            )
            writer.write(encode_json(FrameType.LAYOUT, {**header, **proof}))
            payload = struct.pack("!I", fetch["first_block"]) + bytes(block_nbytes)
            if self.mode.startswith("corrupt"):
                bad_crc = zlib.crc32(payload) ^ 0xDEADBEEF
                writer.write(HEADER.pack(MAGIC, VERSION, int(FrameType.BLOCK), 0, len(payload), bad_crc) + payload)
            else:  # truncated: a header promising the whole block, then half of it
                writer.write(
                    HEADER.pack(MAGIC, VERSION, int(FrameType.BLOCK), 0, len(payload), zlib.crc32(payload))
                    + payload[: len(payload) // 2]
                )
            await writer.drain()
        finally:
            writer.close()


async def _pull_from(
    cluster: Cluster, decode: Proc, *, fake: FakePrefillKV, prompt: list[int], first_token_id: int, stream: bool
) -> str:
    """A decode request whose KV is to come from `fake`; the pull fails, so the decode pod
    computes the prompt itself: returns the text it answered."""
    params = cluster.sign(
        {
            "remote_endpoint": fake.endpoint,
            "remote_request_id": "cmpl-fake",
            "num_prompt_tokens": len(prompt),
            "first_token_id": first_token_id,
            "compat_hash": "tinyhash",
            "prompt_digest": prompt_digest(prompt),
        }
    )
    async with httpx.AsyncClient(timeout=15) as http:
        response = await http.post(
            f"{decode.url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
                "stream": stream,
                KV_TRANSFER_PARAMS_FIELD: params,
            },
        )
    assert response.status_code == 200, response.text
    if not stream:
        return str(response.json()["choices"][0]["text"])
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert all("error" not in chunk for chunk in chunks), chunks
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


@pytest.mark.parametrize("mode", ["corrupt", "truncated"])
async def test_broken_kv_frame_falls_back_to_local_compute_and_frees_blocks(
    cluster: Cluster, reference: Reference, mode: str
) -> None:
    """A corrupt or truncated KV frame: the reserved blocks are freed (never indexed) and the
    decode pod computes the prompt itself, answering what the aggregated engine does."""
    decode = cluster.decode[0]
    offset = 5 if mode == "corrupt" else 300
    prompt = list(range(offset, offset + 3 * BLOCK_SIZE + 5))  # 4 blocks, none cached yet
    want_text, want_tokens = await asyncio.to_thread(reference.generate, prompt, max_tokens=8, ignore_eos=True)
    failures = decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL)
    async with FakePrefillKV(mode=f"{mode}:{len(prompt)}", cluster=cluster) as fake:
        for stream in (False, True):
            text = await _pull_from(
                cluster, decode, fake=fake, prompt=prompt, first_token_id=want_tokens[0], stream=stream
            )
            assert text == want_text
        # the first pull found nothing cached; the local compute then cached the 3 full
        # blocks of the prompt (its own, not the broken frames), so the second asks for block 3;
        # after each broken pull the export is released at once (a FETCH from past the last
        # block, which pulls nothing), not left to its lease
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        assert [f["first_block"] for f in fake.fetches] == [0, num_blocks, 3, num_blocks]
    assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == failures + 2
    assert f"code {mode})" in decode.log_tail(num_chars=1_000_000)
    await asyncio.to_thread(
        wait_for, lambda: _decode_idle(cluster), timeout_seconds=5, what="the decode pod's KV usage back to 0"
    )


def test_unclaimed_kv_expires_and_a_late_pull_is_computed_on_decode(cluster: Cluster, reference: Reference) -> None:
    prefill = cluster.prefill[0]
    assert prefill.metric(Metric.KV_CACHE_USAGE_RATIO) == 0.0
    response = httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=15,
        json={
            "model": MODEL_NAME,
            "prompt": STORY,
            "max_tokens": 1,
            "temperature": 0,
            KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True},
        },
    )
    assert response.status_code == 200, response.text
    params = response.json()[KV_TRANSFER_PARAMS_FIELD]
    assert params["remote_endpoint"] == f"{prefill.host}:{prefill.kv_port}"
    assert params["num_prompt_tokens"] == len(cluster_tokenizer(cluster).encode(STORY))
    assert params["compat_hash"] == "tinyhash" and isinstance(params["first_token_id"], int)
    assert prefill.metric(Metric.KV_CACHE_USAGE_RATIO) > 0.0  # pinned for the decode pod
    wait_for(
        lambda: prefill.metric(Metric.KV_CACHE_USAGE_RATIO) == 0.0,
        timeout_seconds=KV_TTL_SECONDS + 3,
        what="the lease to free the exported KV",
    )
    decode = cluster.decode[1]
    failures = decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL)
    want_text, _ = reference.generate(reference.tokenizer.encode(STORY), max_tokens=4, ignore_eos=True)
    late = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=15,
        json={
            "model": MODEL_NAME,
            "prompt": STORY,
            "max_tokens": 4,
            "ignore_eos": True,
            "temperature": 0,
            KV_TRANSFER_PARAMS_FIELD: params,
        },
    )
    assert late.status_code == 200, late.text
    assert late.json()["choices"][0]["text"] == want_text
    assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    assert "code unknown_request)" in decode.log_tail(num_chars=1_000_000)
    wait_for(lambda: _decode_idle(cluster), timeout_seconds=5, what="decode KV usage back to 0")


def test_bad_handoff_params_are_client_errors(cluster: Cluster) -> None:
    decode, prefill = cluster.decode[0], cluster.prefill[0]
    cases = [
        (decode, {"do_remote_decode": True}),  # prefill work sent to a decode pod
        (
            prefill,
            {"remote_endpoint": "127.0.0.1:1", "remote_request_id": "x", "num_prompt_tokens": 3, "first_token_id": 1},
        ),
        (decode, {"remote_endpoint": "127.0.0.1:1", "remote_request_id": "x"}),  # fields missing
    ]
    for pod, params in cases:
        response = httpx.post(
            f"{pod.url}/v1/completions",
            timeout=15,
            json={"model": MODEL_NAME, "prompt": STORY, "max_tokens": 2, KV_TRANSFER_PARAMS_FIELD: params},
        )
        assert response.status_code == 400, (pod.name, response.text)
        assert response.json()["error"]["code"] == "invalid_kv_transfer_params"


# --------------------------------------------------------------------------- killed pods
# These kill pods, so each has a cluster of its own. The router polls health only every 30 s
# here, so it is the request path, not the poller, that notices the dead pods.

CLEAN_ERROR_SECONDS = 10.0


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0, timeout=30)


def test_killed_prefill_pod_is_retried_on_the_other(own_cluster: Cluster, reference: Reference) -> None:
    cluster, client = own_cluster, _client(own_cluster)
    router = cluster.router
    assert router is not None
    prompt = f"{STORY}, said the prefill probe"
    before = [p.metric(Metric.REQUESTS_TOTAL, outcome="success") for p in cluster.prefill]
    first = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    served = [
        p.metric(Metric.REQUESTS_TOTAL, outcome="success") - b for p, b in zip(cluster.prefill, before, strict=True)
    ]
    victim = cluster.prefill[served.index(1)]
    victim.kill()  # affinity will pick it again for the same prompt
    retries = router.metric("splitserve_router_prefill_retries_total")
    again = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == first.choices[0].text
    assert router.metric("splitserve_router_prefill_retries_total") == retries + 1
    # and the dead pod is skipped from now on: no further retries
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert router.metric("splitserve_router_prefill_retries_total") == retries + 1
    want, _ = reference.generate(reference.tokenizer.encode(prompt), max_tokens=12, ignore_eos=True)
    assert again.choices[0].text == want


def test_decode_pod_killed_mid_stream_gives_a_clean_error(own_cluster: Cluster) -> None:
    cluster, client = own_cluster, _client(own_cluster)
    busy_before = [p.metric(Metric.GENERATION_TOKENS_TOTAL) for p in cluster.decode]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=STORY, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    busy: list[float] = []

    def one_is_busy() -> bool:
        busy[:] = [
            p.metric(Metric.GENERATION_TOKENS_TOTAL) - b for p, b in zip(cluster.decode, busy_before, strict=True)
        ]
        return max(busy) > 0

    wait_for(one_is_busy, timeout_seconds=2, what="the decode pod's first tokens")
    assert min(busy) == 0
    victim = cluster.decode[busy.index(max(busy))]
    killed_at = time.monotonic()
    victim.kill()
    received = 2
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            received += 1
    elapsed = time.monotonic() - killed_at
    assert elapsed < CLEAN_ERROR_SECONDS
    assert received < 400  # it really ended early
    assert "died mid-stream" in str(caught.value)
    # the survivor serves the next requests, streamed and not
    survivor = next(p for p in cluster.decode if p is not victim)
    served = survivor.metric(Metric.REQUESTS_TOTAL, outcome="success")
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0, stream=True)
        if c.choices
    )
    whole = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0)
    assert whole.choices[0].text == text
    assert survivor.metric(Metric.REQUESTS_TOTAL, outcome="success") == served + 2
