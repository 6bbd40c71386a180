"""The attention launchers reject bad inputs with a ValueError naming the problem."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_refs import DEVICE

from splitserve_runtime.kernels.decode_attention import decode_attention
from splitserve_runtime.kernels.prefill_attention import prefill_attention


def _decode_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        q=torch.randn((2, 4, 64), device=DEVICE),
        k_cache=torch.randn((4, 16, 2, 64), device=DEVICE),
        v_cache=torch.randn((4, 16, 2, 64), device=DEVICE),
        block_tables=torch.zeros((2, 2), dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([3, 20], dtype=torch.int32, device=DEVICE),
        max_context_len=20,
        scale=0.125,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"q": torch.randn((2, 3, 64))}, "multiple of num_kv_heads"),
        ({"q": torch.randn((2, 4, 32))}, "head_dim"),
        ({"q": torch.randn((2, 4, 64)).to(torch.bfloat16)}, "KV cache is"),
        ({"q": torch.randn((2, 4))}, "3 dimensions"),
        ({"max_context_len": 33}, "block_tables has 2 columns"),
        ({"context_lens": torch.tensor([3.0, 20.0])}, "context_lens must have dtype"),
        ({"block_tables": torch.zeros((3, 2), dtype=torch.int32)}, "context_lens has 2"),
        ({"scale": float("nan")}, "scale"),
        ({"num_splits": 0}, "num_splits"),
        ({"block_n": 24}, "block_n"),
        ({"k_cache": torch.randn((4, 12, 2, 64))}, "power of two"),
    ],
)
def test_decode_rejects(overrides: dict[str, Any], match: str) -> None:
    overrides = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}
    if "k_cache" in overrides:
        overrides["v_cache"] = overrides["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        decode_attention(**_decode_args(**overrides))


def test_prefill_rejects_bad_cu_seqlens_and_q_len() -> None:
    args = _decode_args(q=torch.randn((5, 4, 64), device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens_q must have 3"):
        prefill_attention(**args, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE), max_q_len=5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_q_len"):
        prefill_attention(**args, cu_seqlens_q=cu, max_q_len=21)
