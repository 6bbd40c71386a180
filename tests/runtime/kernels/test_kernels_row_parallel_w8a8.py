"""The Triton backend's W8A8 path for a tensor-parallel rank's row-parallel share.

Such a share (``act_amax_reduce`` set) must quantize its slice of the activations with the
whole row's per-token scale, not its slice's: otherwise TP 2 answers differ from TP 1's (the
defect ``test_quantized_tensor_parallel.py`` pins on the torch backend). Here the other rank is
stood in for by a second activation slice whose amax the reducer folds in; the Triton backend
must give the torch reference's result for that reduced scale, which differs from the
slice-only one. On CPU this runs under ``TRITON_INTERPRET=1`` (conftest).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_quant_gemm import activations, assert_gemm_close, fp8_weight, int8_weight

from splitserve_runtime.ops.triton_backend import TritonOps
from splitserve_runtime.quant import reference
from splitserve_runtime.quant.formats import Fp8Weight, Int8Weight


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_share_quantizes_with_the_whole_rows_scale(kind: str, dtype: torch.dtype) -> None:
    m, k, n = 9, 64, 48
    x = activations(m, k, 11, dtype)
    other = activations(m, k, 12, dtype) * 3  # the other rank's slice: larger on most rows
    other_amax = other.float().abs().amax(dim=1, keepdim=True)
    calls: list[int] = []

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        calls.append(amax.shape[0])
        return torch.maximum(amax, other_amax)

    base: Fp8Weight | Int8Weight = fp8_weight(n, k, 13) if kind == "fp8" else int8_weight(n, k, 13, act_quant=True)
    share = dataclasses.replace(base, act_amax_reduce=reduce)
    out = TritonOps().linear(x, share, None)
    ref = reference.quant_linear(x, share, None)
    assert_gemm_close(out, ref, x, share, weight_only=False)
    assert calls == [m, m], calls  # once by each backend, over all the rows
    # the reduced scale is what made the difference: the slice-only result is another one
    assert not torch.equal(ref, reference.quant_linear(x, base, None))
