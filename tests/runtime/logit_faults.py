"""A fault no CPU model makes on demand: NaN or infinite logits in one request's row.

:func:`poison` wraps a real :class:`~splitserve_runtime.engine.sampler.Sampler`'s ``launch``
(the one door every step mode's logits pass) and spoils the marked request's rows before the
real sampler sees them, as an fp16/fp8 overflow in the model's last layers would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from splitserve_runtime.engine.sampler import Sampler
from splitserve_runtime.engine.sampling_params import SamplingParams


def poison(
    sampler: Sampler,
    *,
    marked: Callable[[str, SamplingParams], bool],
    at_output: int,
    fault: Callable[[torch.Tensor], object],
) -> None:
    """From the ``at_output``-th sampled row (0: the first token) of each request that
    ``marked(request_id, params)`` on, apply ``fault`` to its row of the logits before the real
    sampler sees them."""
    real_launch = sampler.launch
    seen: dict[str, int] = {}

    def launch(
        *,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        banned_token_ids: list[list[int]] | None = None,
    ) -> Any:
        rows = []
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if marked(rid, p):
                seen[rid] = seen.get(rid, 0) + 1
                if seen[rid] > at_output:
                    rows.append(i)
        if rows:
            logits = logits.clone()
            for i in rows:
                fault(logits[i])
        return real_launch(logits=logits, request_ids=request_ids, params=params, banned_token_ids=banned_token_ids)

    sampler.launch = launch  # type: ignore[method-assign]
