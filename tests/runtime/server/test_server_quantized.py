"""Every quantization the API accepts serves through the OpenAI API (the official client
against the real server, tiny checkpoint, CPU): load-time fp8/int8/int4 and the pre-quantized
checkpoint formats; an unsupported ``quantization_config`` stops ``splitserve serve`` with one
ModelLoadError line in the termination message (which the operator turns into a
``Stalled``/``ModelUnavailable`` condition), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from quant_packers import FORMATS, write_quantized
from server_harness import MODEL_NAME, serve_args, serve_until_exit, start_server

from splitserve_contract import ENV_MODEL_CACHE
from splitserve_contract import capabilities as caps
from splitserve_e2e import smollm2

CASES = (
    [("load-time", method) for method in caps.QUANTIZATION.supported]
    + [("checkpoint", fmt) for fmt in ("awq-g64", "gptq-asym", "ct-fp8", "ct-int8", "ct-int4", "autofp8")]
    + [("gguf", "smollm2")]
)


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_each_quantization_serves_completions_and_chat(
    tiny_llama_dir: Path, tmp_path: Path, kind: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, quantization = tiny_llama_dir, "none"
    if kind == "load-time":
        quantization = str(name)
    elif kind == "gguf":  # a real GGUF file (SmolLM2-135M-Instruct, Q4_1) as the model path
        model_dir = smollm2.gguf_path()
        monkeypatch.setenv(ENV_MODEL_CACHE, str(tmp_path / "cache"))  # where its sidecar goes
    else:
        config, encode, _ = FORMATS[name]
        model_dir = tmp_path / name
        write_quantized(tiny_llama_dir, model_dir, config=config, encode=encode)
    args = serve_args(model_dir=model_dir, quantization=quantization)
    with start_server(args=args) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert completion.choices[0].finish_reason == "length"
        again = client.completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].text == completion.choices[0].text  # greedy is deterministic
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.role == "assistant"


def test_unsupported_checkpoint_stops_the_server_with_one_clear_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "bnb"))
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (model_dir / "config.json").write_text(json.dumps(raw))
    code, output, message = serve_until_exit(
        args=serve_args(model_dir=model_dir, port=0), termination_log=tmp_path / "termination-log"
    )
    assert code == 1, output
    assert message.startswith("ModelLoadError: "), message
    assert "quant_method 'bitsandbytes' is not supported (supported: compressed-tensors, fp8, awq, gptq)" in message
    assert "Traceback" not in message
