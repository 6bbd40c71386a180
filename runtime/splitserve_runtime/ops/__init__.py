"""Kernel backends behind the :class:`~splitserve_runtime.ops.interface.Ops` protocol.

:func:`get_ops` is the one place that picks a backend: ``torch`` (reference, CPU), ``triton``
(GPU kernels) or ``auto`` (Triton on CUDA, torch elsewhere). The Triton backend is imported
lazily so that CPU-only installs never import Triton.
"""

from __future__ import annotations

import os

import torch

from .interface import AttentionMetadata, Ops

BACKEND_NAMES = ("auto", "torch", "triton")

__all__ = ["BACKEND_NAMES", "AttentionMetadata", "Ops", "get_ops"]


def get_ops(*, name: str, device: torch.device) -> Ops:
    """Return the kernel backend ``name`` (one of :data:`BACKEND_NAMES`) for ``device``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchOps

        return TorchOps()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1), got {device}")
    from .triton_backend import TritonOps

    return TritonOps()
