"""Fixtures every disaggregated-serving test module shares: one tiny checkpoint for the session
(the pods and the reference engine load the same files) and the aggregated reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg_harness import Reference


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve_runtime.model.tiny import write_tiny_model

    out: Path = write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
    return out


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir=model_dir)
