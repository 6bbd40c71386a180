"""The handoff parameters bind the prompt (the cross-user prefix-cache poisoning defect), in the
decode engine itself: two in-process :class:`HandoffEngine` pods of the tiny model on loopback,
with and without a handoff key.

Before the fix, a prefill pod's genuine parameters for prompt A presented with a prompt B of the
same length made the decode engine pull A's KV, answer with A's continuation and index A's blocks
in its prefix cache under B's block hashes; every later request starting with B then got A's KV.
Now both entry points refuse them (``prompt_mismatch``) before anything is reserved or connected
to: :meth:`HandoffEngine.accept_remote` (where the parameters come in: parsed and authenticated
once, for the prompt this pod tokenized) and :meth:`HandoffEngine.generate_from_remote` (which
takes only what ``accept_remote`` verified, and refuses it with any other prompt). The decode engine's prefix cache
stays empty, B is then computed from B's own tokens as on an engine that never saw the attempt,
and A's export stays for A's real decode. A first token outside the vocabulary is refused at
:meth:`~HandoffEngine.accept_remote` too, so the HTTP layer can fall back before any work.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_contract.block_hash import prompt_digest
from splitserve_contract.handoff import HandoffParams
from splitserve_runtime.disagg.engine import HandoffEngine
from splitserve_runtime.engine.async_engine import AsyncEngine
from splitserve_runtime.engine.errors import HandoffRefused
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.transfer import HandoffAuth, HandoffKey

ARGS = ServeArgs(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_model_len=128,
    max_num_batched_tokens=128,
    compat_hash="binding",
)
KEY = HandoffKey(b"binding-test-key-0123456789abcdef")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NUM_TOKENS = 24
"""Six full blocks of 4."""


async def _pod(model_dir: Path, role: str, key: HandoffKey | None) -> tuple[HandoffEngine, AsyncEngine]:
    args = dataclasses.replace(ARGS, model=str(model_dir), role=role)
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
    return handoff, engine


async def _tokens(stream: AsyncIterator[RequestOutput]) -> tuple[list[int], int]:
    """(token ids, the first output's num_cached_tokens)."""
    tokens: list[int] = []
    cached = -1
    async for out in stream:
        cached = out.num_cached_tokens if cached < 0 else cached
        tokens.extend(out.new_token_ids)
    return tokens, cached


def _reference(model_dir: Path, prompt: list[int]) -> list[int]:
    engine = LLMEngine.from_args(dataclasses.replace(ARGS, model=str(model_dir)))
    engine.add_request(request_id="ref", prompt_token_ids=prompt, params=GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def _prompt(vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(NUM_TOKENS)]


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "loopback-no-key"])
async def test_params_of_prompt_a_never_import_kv_for_prompt_b(tiny_llama_dir: Path, key: HandoffKey | None) -> None:
    (prefill, _), (decode, engine) = (
        await _pod(tiny_llama_dir, "prefill", key),
        await _pod(tiny_llama_dir, "decode", key),
    )
    try:
        vocab_size = engine.engine.vocab_size
        prompt_a, prompt_b = _prompt(vocab_size, 1), _prompt(vocab_size, 2)
        want_a, want_b = _reference(tiny_llama_dir, prompt_a), _reference(tiny_llama_dir, prompt_b)
        assert want_a != want_b
        exported: list[HandoffParams] = []
        async for _ in prefill.generate_for_export(
            request_id="a",
            prompt_token_ids=prompt_a,
            params=dataclasses.replace(GREEDY, max_tokens=1),
            on_export=exported.append,
        ):
            pass
        params = exported[0].to_json()
        assert params["prompt_digest"] == prompt_digest(prompt_a) and params["num_prompt_tokens"] == NUM_TOKENS
        assert ("signature" in params) == (key is not None)
        pulled: list[int] = []
        decode.set_observer(lambda num_bytes, _s, _ok: pulled.append(num_bytes))

        with pytest.raises(HandoffRefused) as refused:  # what the HTTP layer asks first
            decode.accept_remote(params, prompt_token_ids=prompt_b)
        assert refused.value.code == "prompt_mismatch"
        with pytest.raises(HandoffRefused) as refused:  # and A's verified handoff with B, before any work
            await _tokens(
                decode.generate_from_remote(
                    request_id="b-attack",
                    prompt_token_ids=prompt_b,
                    params=GREEDY,
                    source=decode.accept_remote(params, prompt_token_ids=prompt_a),
                )
            )
        assert refused.value.code == "prompt_mismatch"
        assert pulled == []  # no connection was made
        assert len(prefill.registry) == 1  # A's export waits for A's real decode
        cache = await engine.call(
            lambda core: (core.block_manager.num_cached_blocks, core.block_manager.usage_ratio, len(core._reserved))
        )
        assert cache == (0, 0.0, 0)  # nothing reserved, nothing indexed under B's hashes

        # B, as a later user sends it, is computed from its own tokens
        assert await _tokens(decode.generate(request_id="b", prompt_token_ids=prompt_b, params=GREEDY)) == (want_b, 0)
        # and A with its own parameters still pulls its KV and decodes A's continuation
        source = decode.accept_remote(params, prompt_token_ids=prompt_a)
        tokens, _ = await _tokens(
            decode.generate_from_remote(request_id="a", prompt_token_ids=prompt_a, params=GREEDY, source=source)
        )
        assert tokens == want_a and sum(pulled) > 0
    finally:
        await prefill.shutdown()
        await decode.shutdown()


async def test_a_first_token_outside_the_vocabulary_is_refused_before_any_work(tiny_llama_dir: Path) -> None:
    decode, engine = await _pod(tiny_llama_dir, "decode", None)
    vocab_size = engine.engine.vocab_size
    try:
        prompt = _prompt(vocab_size, 3)
        params: dict[str, Any] = {
            "remote_endpoint": "127.0.0.1:1",
            "remote_request_id": "r",
            "num_prompt_tokens": len(prompt),
            "first_token_id": vocab_size,
            "compat_hash": "binding",
            "prompt_digest": prompt_digest(prompt),
        }
        with pytest.raises(ValueError, match="outside the vocabulary"):
            decode.accept_remote(params, prompt_token_ids=prompt)
        decode.accept_remote({**params, "first_token_id": vocab_size - 1}, prompt_token_ids=prompt)
    finally:
        await decode.shutdown()
