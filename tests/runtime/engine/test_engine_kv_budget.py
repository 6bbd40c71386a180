"""KV pool sizing at start-up, and device/dtype resolution of LLMEngine.from_args."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.kv_budget import (
    KVCacheSpec,
    available_host_memory_bytes,
    num_blocks_for_budget,
)
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.serve_settings import resolve_device, resolve_dtype

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    assert SPEC.bytes_per_block(block_size=16) == 2 * 2 * 16 * 2 * 16 * 4
    half = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert half.bytes_per_block(block_size=16) * 2 == SPEC.bytes_per_block(block_size=16)


def test_num_blocks_for_budget_caps_and_rejects_tiny_budgets() -> None:
    per_block = SPEC.bytes_per_block(block_size=16)
    assert num_blocks_for_budget(budget_bytes=per_block * 10 + 5, spec=SPEC, block_size=16, max_useful_blocks=100) == 10
    assert num_blocks_for_budget(budget_bytes=per_block * 10, spec=SPEC, block_size=16, max_useful_blocks=4) == 4
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        num_blocks_for_budget(budget_bytes=per_block - 1, spec=SPEC, block_size=16, max_useful_blocks=4)


def test_meminfo_parsing(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         200 kB\nMemAvailable:    500 kB\n")
    assert available_host_memory_bytes(meminfo_path=meminfo) == 500 * 1024
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         200 kB\n")
    assert available_host_memory_bytes(meminfo_path=meminfo) == 200 * 1024
    assert available_host_memory_bytes() > 0


def test_from_args_measures_the_cpu_pool(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_args(
        ServeArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=64, max_num_seqs=3, block_size=16)
    )
    # CPU budget is far larger than what 3 sequences of 64 tokens can use: capped at that
    assert engine.block_manager.num_blocks == 3 * 4 + 1
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.shape == v_cache.shape == (13, 16, 2, 16)
    assert k_cache.dtype == torch.float32 and engine.max_model_len == 64


def test_from_args_clamps_max_model_len_without_chunked_prefill(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_args(
        ServeArgs(
            model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8, chunked_prefill=False, max_num_batched_tokens=100
        )
    )
    assert engine.max_model_len == 100


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", device=cpu, config_dtype="bfloat16") == torch.float32
    assert resolve_dtype("auto", device=cuda, config_dtype="float16") == torch.float16
    assert resolve_dtype("auto", device=cuda, config_dtype="float32") == torch.bfloat16
    assert resolve_dtype("bfloat16", device=cpu, config_dtype=None) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", device=cpu, config_dtype=None)


def test_kv_block_bytes_round_trip_between_runners(tiny_llama_dir: Path) -> None:
    args = ServeArgs(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8, block_size=4, max_model_len=64)
    src, dst = LLMEngine.from_args(args), LLMEngine.from_args(args)
    for k, v in src.runner.kv_caches:
        k[3].normal_()
        v[3].normal_()
    data = src.runner.read_block(3)
    assert len(data) == src.runner.spec.bytes_per_block(block_size=4)
    dst.runner.write_block(5, data)
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
        assert torch.equal(sk[3], dk[5]) and torch.equal(sv[3], dv[5])
        assert torch.count_nonzero(dk[3]) == 0
    with pytest.raises(ValueError, match="bytes"):
        dst.runner.write_block(1, data[:-4])
    with pytest.raises(ValueError, match="outside"):
        src.runner.read_block(8)
