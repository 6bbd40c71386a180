"""Make Triton 3.6's CPU interpreter usable with NumPy >= 2.4.

Under ``TRITON_INTERPRET=1`` every scalar inside a kernel is a one-element NumPy array, and
Triton 3.6 turns it into a Python ``int`` with ``int(array)`` whenever a loop bound is not a
compile-time constant (``for i in range(start, end, BLOCK)``). NumPy 2.4 removed ``int()`` on
arrays with ``ndim > 0``, so every kernel with a runtime loop bound fails with
``TypeError: only 0-dimensional arrays can be converted to Python scalars`` (Triton 3.8 fixed
it). Rather than contorting the kernels (a ``while`` loop would lose software pipelining on
the GPU), we patch the interpreter's per-launch tensor patch to use ``.item()``. Compiled
(GPU) execution is never touched: the fix only applies when the interpreter is on.
"""

from __future__ import annotations

import os
from typing import Any


def _needs_fix() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy as np
    import triton

    np_major, np_minor = (int(p) for p in np.__version__.split(".")[:2])
    tr_major, tr_minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (np_major, np_minor) >= (2, 4) and (tr_major, tr_minor) < (3, 8)


def apply_interpreter_fixes() -> bool:
    """Apply the fix if the interpreter is on and affected; return whether it is applied."""
    if not _needs_fix():
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_splitserve_fixed", False):
        return original is not None

    def _index(self: Any) -> int:
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patched._splitserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
    return True
