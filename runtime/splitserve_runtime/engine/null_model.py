"""A model-shaped stand-in that does no compute: for engine tests and the overhead benchmark.

It has the model's call signature (``forward`` / ``compute_logits``) and its logits are a
deterministic function of the input token alone: the next token after ``t`` is
``(t * 31 + 7) % vocab_size``. Engine bookkeeping (scheduling, block tables, metadata,
sampling) is exercised for real while the model's cost is nearly zero.

``forward_seconds`` makes each forward take a fixed time without using the CPU (a sleep,
which releases the GIL as a real kernel does): the stand-in for a device forward when
measuring how much of the engine's bookkeeping hides behind it (:mod:`.step_overlap`).
"""

from __future__ import annotations

import time

import torch

from ..ops.interface import AttentionMetadata
from .config import EngineConfig
from .kv_budget import KVCacheSpec
from .llm_engine import LLMEngine


def null_next_token(token_id: int, *, vocab_size: int) -> int:
    """The token :class:`NullModel` predicts after ``token_id`` (greedy)."""
    return (token_id * 31 + 7) % vocab_size


class NullModel:
    """Deterministic logits from input ids; ignores the KV cache."""

    def __init__(
        self,
        *,
        vocab_size: int = 1024,
        num_layers: int = 1,
        num_kv_heads: int = 1,
        head_dim: int = 8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        forward_seconds: float = 0.0,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if forward_seconds < 0:
            raise ValueError(f"forward_seconds must be >= 0, got {forward_seconds}")
        self.forward_seconds = forward_seconds
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.num_forward_calls = 0

    def forward(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        if input_ids.shape != positions.shape:
            raise ValueError("input_ids and positions must have the same shape")
        if md.num_prefill_tokens + md.num_decodes != input_ids.shape[0]:
            raise ValueError("attention metadata does not match the number of tokens")
        self.num_forward_calls += 1
        if self.forward_seconds:
            time.sleep(self.forward_seconds)
        return input_ids.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[:, 0].to(torch.int64)
        target = (ids * 31 + 7) % self.vocab_size
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32, device=hidden.device)
        # A peaked but not one-hot distribution, so sampling with temperature is non-trivial.
        logits += torch.linspace(0.0, 1.0, self.vocab_size, device=hidden.device)
        logits.scatter_(1, target.unsqueeze(1), 8.0)
        return logits


def build_null_engine(*, config: EngineConfig, vocab_size: int = 1024, forward_seconds: float = 0.0) -> LLMEngine:
    """An :class:`LLMEngine` over a :class:`NullModel` (CPU, no tokenizer, eos = none)."""
    model = NullModel(vocab_size=vocab_size, forward_seconds=forward_seconds)
    spec = KVCacheSpec(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype
    )
    return LLMEngine(
        model=model, kv_spec=spec, vocab_size=vocab_size, config=config, device=torch.device("cpu"), model_name="null"
    )
