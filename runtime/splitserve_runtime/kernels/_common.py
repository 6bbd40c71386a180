"""Launcher helpers shared by the kernel modules: input validation and interpreter detection.

Validation raises ``ValueError`` with a message naming the argument, so that a shape or dtype
mistake in the model surfaces at the Python boundary instead of as a wrong result or an
illegal memory access inside a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when kernels run on the CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter mis-computes ``tl.dot`` on bf16 operands, so kernels take a constexpr
    flag that upcasts dot operands to fp32 there; on the GPU dots stay bf16/fp16 with fp32
    accumulation.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if last_dim_contiguous and t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
