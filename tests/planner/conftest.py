"""Shared planner fixtures: performance models and small workloads (no torch)."""

from __future__ import annotations

import pytest

from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import RooflineModel, roofline_model


@pytest.fixture(scope="session")
def llama8b_h100() -> RooflineModel:
    name, config = load_model(name_or_path="llama-3.1-8b")
    return roofline_model(name=name, config=config, gpu=get_gpu("H100-SXM"), tensor_parallel=1, dtype="bfloat16")
