"""A request whose prompt + max_tokens needs more KV blocks than the whole cache holds is
refused at admission (400, both numbers named), and a server whose cache is smaller than one
``max_model_len`` sequence says so at start-up in one WARNING.

The defect this pins: such a request was admitted and silently cut short with
``finish_reason: "length"`` once the cache ran out, and a server with a cache smaller than
``max_model_len`` started without a word.

The real ``splitserve serve`` process (:func:`server_harness.spawn_server`), CPU, the tiny
checkpoint, ``--num-kv-blocks 4 --block-size 16``: a 64-token cache under a 512-token context.
A request of ``n`` tokens caches ``n - 1`` of them (the last sampled token is never fed back),
so 65 tokens is the longest request that fits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL_NAME, serve_args, wait_until

from splitserve_contract import serve_argv
from splitserve_e2e.net import free_port

NUM_BLOCKS = 4
BLOCK_SIZE = 16
CAPACITY_TOKENS = NUM_BLOCKS * BLOCK_SIZE  # 64
MAX_MODEL_LEN = 512
PROMPT = [5] * 10
LONGEST_FIT = CAPACITY_TOKENS + 1 - len(PROMPT)  # 55 completion tokens


class _Served:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = serve_args(
            model_dir=model_dir,
            port=self.port,
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
        )
        with log_path.open("w") as log:  # a file, so the log can be read while it serves
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(args)],
                env=dict(os.environ),
                text=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log_path.read_text()

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(self.output() or "server exited")
        try:
            return httpx.get(f"{self.base}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, **body: object) -> httpx.Response:
        return httpx.post(
            f"{self.base}/v1/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body},
        )


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Served]:
    running = _Served(tiny_llama_dir, tmp_path_factory.mktemp("kv-capacity") / "server.log")
    try:
        wait_until(running.ready, timeout_s=120, what="the server to become ready")
        yield running
    finally:
        running.proc.kill()
        running.proc.wait(10)


def test_request_over_the_kv_cache_is_refused_with_both_numbers(served: _Served) -> None:
    answer = served.complete(max_tokens=LONGEST_FIT + 1)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    message = error["message"]
    assert "exceeds the KV cache capacity" in message
    assert f"{len(PROMPT) + LONGEST_FIT + 1} tokens" in message  # what the request asks for
    assert f"({CAPACITY_TOKENS} tokens)" in message  # what the cache holds
    assert f"at most {LONGEST_FIT}" in message  # and what would fit


def test_request_that_fits_the_kv_cache_gets_its_full_length(served: _Served) -> None:
    answer = served.complete(max_tokens=LONGEST_FIT)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["completion_tokens"] == LONGEST_FIT
    assert body["choices"][0]["finish_reason"] == "length"


def test_omitted_max_tokens_fills_the_cache_not_the_context(served: _Served) -> None:
    # chat completions default max_tokens to the room left (completions default to 16)
    answer = httpx.post(
        f"{served.base}/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CAPACITY_TOKENS + 1


def test_startup_warns_that_the_cache_is_smaller_than_max_model_len(served: _Served) -> None:
    output = served.output()  # the server is ready, so start-up is over
    warnings = [line for line in output.splitlines() if re.search(r"\bWARNING\b", line) and "KV cache holds" in line]
    assert len(warnings) == 1, output[-4000:]
    (line,) = warnings
    assert f"holds {CAPACITY_TOKENS} tokens" in line
    assert f"max_model_len {MAX_MODEL_LEN} tokens" in line
    assert f"--max-model-len to {CAPACITY_TOKENS + 1}" in line
