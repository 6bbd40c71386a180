"""The tiny checkpoint the router tests' real runtime pods serve: written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve_runtime.model.tiny import write_tiny_model

    out: Path = write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
    return out
