"""Shared runtime fixtures: tiny checkpoints written once per test session.

``tiny_llama_dir`` (Llama-3 style tokenizer and chat template) and ``tiny_qwen2_dir``
(ChatML, QKV bias, no BOS) are real Hugging Face-format directories that both our loader
and ``transformers`` read; other runtime tests (engine, server) use them too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve_runtime.model.tiny import write_tiny_model

    return write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve_runtime.model.tiny import write_tiny_model

    return write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)
