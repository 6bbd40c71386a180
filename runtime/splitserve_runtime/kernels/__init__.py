"""Triton kernels of the runtime, one module per kernel.

Each module holds the ``@triton.jit`` kernel(s) and a thin typed launcher that validates
shapes, dtypes and strides at the Python boundary (``ValueError`` with a message) and picks
the launch configuration. :class:`~splitserve_runtime.ops.triton_backend.TritonOps` wires
them into the :class:`~splitserve_runtime.ops.interface.Ops` protocol.

Importing this package applies a small compatibility fix for the CPU interpreter
(``TRITON_INTERPRET=1``) when it is needed; see :mod:`._interpret_compat`.
"""

from __future__ import annotations

from ._interpret_compat import apply_interpreter_fixes

apply_interpreter_fixes()
