"""Run the Triton kernel tests on the CPU interpreter when no CUDA device is present.

``TRITON_INTERPRET`` is read when Triton is imported, so it is set here, before any test
module of this folder imports a kernel. On a CUDA machine the kernels are compiled instead
(same tests, real GPU code paths).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
