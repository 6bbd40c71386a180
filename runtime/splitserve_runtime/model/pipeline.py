"""Which decoder layers a pipeline stage holds, and how its checkpoint names map.

Pipeline parallelism cuts the layer stack into consecutive stages, one per rank group: the
first stage also embeds the tokens, the last also applies the final norm and the LM head
(with tied embeddings it holds the embedding matrix for that). Layers are split as evenly as
they divide; when they do not, the last stages get one layer fewer, because the last stage
also pays for the LM head (a vocabulary-sized GEMM).

A stage's model is an ordinary model of a *local* config with ``num_hidden_layers`` = its
layer count; the loader renames the checkpoint's ``model.layers.{global}`` tensors to the
stage's local indices (:meth:`PipelineStage.local_name`) and skips what the stage does not
hold, so the loader, the quantized-weight assembler and the tensor-parallel sharding need no
pipeline branches.
"""

from __future__ import annotations

import dataclasses
import re

from splitserve_contract.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class PipelineError(ValueError):
    """The model cannot be cut into this many stages."""


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """Stage ``stage`` of ``num_stages`` of a model with ``config``."""

    config: ModelConfig
    stage: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.num_stages < 1 or not 0 <= self.stage < self.num_stages:
            raise PipelineError(f"stage {self.stage} outside a pipeline of {self.num_stages}")
        if self.num_stages > self.config.num_hidden_layers:
            raise PipelineError(
                f"pipeline-parallel size {self.num_stages} exceeds the model's {self.config.num_hidden_layers} layers"
            )

    def layer_range(self, stage: int | None = None) -> tuple[int, int]:
        """Global ``[start, end)`` of ``stage``'s layers (default: this stage)."""
        stage = self.stage if stage is None else stage
        total, n = self.config.num_hidden_layers, self.num_stages
        base, extra = divmod(total, n)
        start = stage * base + min(stage, extra)
        return start, start + base + (1 if stage < extra else 0)

    @property
    def num_layers(self) -> int:
        start, end = self.layer_range()
        return end - start

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def holds_embedding(self) -> bool:
        return self.is_first or (self.is_last and self.config.tie_word_embeddings)

    def local_config(self) -> ModelConfig:
        return dataclasses.replace(self.config, num_hidden_layers=self.num_layers)

    def local_name(self, name: str) -> str | None:
        """Checkpoint tensor ``name`` as the stage's local model knows it, or None when the
        stage does not hold it."""
        match = _LAYER.match(name)
        if match is not None:
            start, end = self.layer_range()
            layer = int(match.group(1))
            return f"model.layers.{layer - start}.{match.group(2)}" if start <= layer < end else None
        if name == "model.embed_tokens.weight":
            return name if self.holds_embedding else None
        if name in ("model.norm.weight", "lm_head.weight"):
            return name if self.is_last else None
        return name
