"""How many KV blocks the cache gets, decided once at start-up.

- An explicit ``num_kv_blocks`` wins (tests, benchmarks, operators pinning a layout).
- CUDA: after weights are loaded and one profiling forward has run at the largest step
  shape, ``free memory × kv_memory_fraction − activation peak`` goes to the KV cache
  (nano-vllm measures the same way).
- CPU: ``kv_memory_fraction`` of ``MemAvailable`` from ``/proc/meminfo``, capped at
  :data:`CPU_KV_CAP_BYTES` — host memory is shared with everything else on the node.

Either way there are never more blocks than ``max_num_seqs`` full-length sequences use.

The cache dtype (``--kv-cache-dtype``) is the activation dtype (``auto``) or fp8 e4m3
(``fp8``): one byte per element, so the same budget holds 2x the blocks of a bf16 cache
(4x of the fp32 cache used on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CPU_KV_CAP_BYTES = 2 * 1024**3
MEMINFO_PATH = Path("/proc/meminfo")
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_MIN_CUDA_CAPABILITY = (8, 9)
"""fp8 e4m3 conversions in Triton need Ada (sm_89) or Hopper (sm_90) and later."""


def resolve_kv_cache_dtype(name: str, *, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: the model's activation dtype; ``fp8``: ``float8_e4m3fn``."""
    if name == "auto":
        return model_dtype
    if name != "fp8":
        raise ValueError(f"unknown KV cache dtype {name!r}; choose {' or '.join(KV_CACHE_DTYPES)}")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_KV_MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, "
                f"Hopper); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )
    return torch.float8_e4m3fn


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Shape of one layer's K (or V) cache, per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, *, block_size: int) -> int:
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element_bytes


def available_host_memory_bytes(*, meminfo_path: Path = MEMINFO_PATH) -> int:
    """``MemAvailable`` in bytes (``MemFree`` if the kernel has no MemAvailable)."""
    fields: dict[str, int] = {}
    for line in meminfo_path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024
    value = fields.get("MemAvailable", fields.get("MemFree"))
    if value is None:
        raise RuntimeError(f"cannot read available memory from {meminfo_path}")
    return value


def cpu_kv_budget_bytes(*, kv_memory_fraction: float) -> int:
    return min(int(available_host_memory_bytes() * kv_memory_fraction), CPU_KV_CAP_BYTES)


def cuda_kv_budget_bytes(*, device: torch.device, kv_memory_fraction: float, activation_peak_bytes: int) -> int:
    """Free device memory (after the profiling run) × fraction, minus the activation peak."""
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return int(free_bytes * kv_memory_fraction) - activation_peak_bytes


def num_blocks_for_budget(
    *, budget_bytes: int, spec: KVCacheSpec, block_size: int, max_useful_blocks: int, extra_bytes_per_block: int = 0
) -> int:
    per_block = spec.bytes_per_block(block_size=block_size) + extra_bytes_per_block
    num_blocks = min(budget_bytes // per_block, max_useful_blocks)
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache: budget {budget_bytes} bytes, one block needs "
            f"{per_block} bytes; lower the model size, "
            "max_num_batched_tokens, or raise kv_memory_fraction"
        )
    return int(num_blocks)
