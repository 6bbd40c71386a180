"""Which slice of each weight, head and vocabulary row a tensor-parallel rank holds.

The split is Megatron's: the fused QKV and gate/up projections are column-parallel (each rank
computes its own heads and its own slice of the MLP's intermediate features), the output and
down projections row-parallel (each rank multiplies its slice of the input features and one
all-reduce sums the partial outputs), the embedding and the LM head vocabulary-parallel
(rows split; the vocabulary is padded to a multiple of the group size).

Heads are split by KV group (:class:`TensorParallelLayout`): with at least as many KV heads
as ranks each rank owns whole groups, as evenly as they divide (uneven when they do not: a
model with 3 KV heads runs at TP 2, which vLLM refuses); with fewer (e.g. 2 KV heads at TP 4)
each KV head is replicated on the ranks that split its query heads, as vLLM and SGLang do.

A rank's model is an ordinary model of a *local* config (:func:`local_config`: its heads,
KV heads, intermediate size and vocabulary rows), so the model class, the loader's
targets and the load-time quantization need no tensor-parallel branches; the loader only
narrows each checkpoint tensor with :meth:`TensorParallelLayout.shard_checkpoint_tensor`
before placing it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Protocol

import torch

from splitserve_contract.model_config import ModelConfig


class Collectives(Protocol):
    """What a sharded model needs from its process group (the engine's group provides it)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        ...

    def gather_vocab(self, local: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
        """Full logits from each rank's vocabulary slice."""
        ...


def all_reduce_max(collectives: Collectives, tensor: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
    """Element-wise max of ``tensor`` over the ``size`` ranks (a new tensor; every rank gets it).

    Built on the group's one reduction, the sum: each rank writes its values into its own slot
    of a zero buffer ``[size, *shape]``, so the sum holds every rank's values exactly (``x + 0``
    is ``x`` in any summation order), and the max is taken locally. That moves ``size`` times
    the tensor's bytes; it is meant for small tensors such as per-token activation amaxes."""
    slots = tensor.new_zeros((size, *tensor.shape))
    slots[rank] = tensor
    return collectives.all_reduce(slots).amax(dim=0)


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks (the message says why)."""


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a group size the model's shapes cannot be split by, naming the shape."""
    if size < 1:
        raise TensorParallelError(f"tensor-parallel size must be >= 1, got {size}")
    kv = config.num_key_value_heads
    group = config.num_attention_heads // kv
    problems = []
    if kv < size and (size % kv or group % (size // kv)):
        problems.append(f"{kv} KV heads with {group} query heads each cannot be replicated evenly")
    if config.intermediate_size % size:
        problems.append(f"the intermediate size {config.intermediate_size} is not divisible")
    if problems:
        raise TensorParallelError(f"tensor-parallel size {size} does not fit the model: {'; '.join(problems)}")


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """One rank's share of a model ``config`` split ``size`` ways.

    Heads are split by KV group (a KV head and the query heads that read it stay together),
    as evenly as the groups allow: 3 KV heads over 2 ranks give one rank 1 group and the other
    2, so a 9-head model serves at TP 2. With fewer KV heads than ranks, each KV head is
    replicated on ``size / num_key_value_heads`` consecutive ranks, which split its query heads."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_divisible(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} outside a group of {self.size}")

    # ------------------------------------------------------------------ heads
    @property
    def _group(self) -> int:
        return self.config.num_attention_heads // self.config.num_key_value_heads

    @property
    def _replicas(self) -> int:
        """Ranks per KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.size // self.config.num_key_value_heads)

    def kv_head_start(self, rank: int | None = None) -> int:
        """First (global) KV head held by ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        kv = self.config.num_key_value_heads
        return rank // self._replicas if kv < self.size else rank * kv // self.size

    def num_kv_heads_of(self, rank: int) -> int:
        kv = self.config.num_key_value_heads
        return 1 if kv < self.size else (rank + 1) * kv // self.size - rank * kv // self.size

    def q_head_start(self, rank: int | None = None) -> int:
        rank = self.rank if rank is None else rank
        per_rank = self._group // self._replicas
        return self.kv_head_start(rank) * self._group + (rank % self._replicas) * per_rank

    def num_heads_of(self, rank: int) -> int:
        return self.num_kv_heads_of(rank) * self._group // self._replicas

    @property
    def num_heads(self) -> int:
        return self.num_heads_of(self.rank)

    @property
    def num_kv_heads(self) -> int:
        return self.num_kv_heads_of(self.rank)

    def kv_head_owner(self, head: int) -> int:
        """The first rank holding (global) KV ``head``: where a whole-model read takes it from."""
        kv = self.config.num_key_value_heads
        if not 0 <= head < kv:
            raise ValueError(f"KV head {head} outside [0, {kv})")
        if kv < self.size:
            return head * self._replicas
        return next(
            r
            for r in range(self.size)
            if self.kv_head_start(r) <= head < self.kv_head_start(r) + self.num_kv_heads_of(r)
        )

    # ------------------------------------------------------------------ MLP, vocabulary
    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per rank (the vocabulary padded up to a multiple of ``size``)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The config of this rank's model: its heads, KV heads, MLP width and vocabulary rows."""
        return dataclasses.replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_rows,
        )

    # ------------------------------------------------------------------ checkpoint tensors
    def projection_slice(self, module: str) -> tuple[int, int, int]:
        """``(dim, start, length)`` of this rank's share of projection ``module``'s weight
        (``self_attn.q_proj`` ... ``mlp.down_proj``): output rows (dim 0) of the
        column-parallel ones, input columns (dim 1) of the row-parallel ones."""
        head_dim = self.config.head_dim
        name = module.rsplit(".", 1)[-1]
        if name == "q_proj":
            return 0, self.q_head_start() * head_dim, self.num_heads * head_dim
        if name in ("k_proj", "v_proj"):
            return 0, self.kv_head_start() * head_dim, self.num_kv_heads * head_dim
        if name == "o_proj":
            return 1, self.q_head_start() * head_dim, self.num_heads * head_dim
        if name in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate_size, self.intermediate_size
        if name == "down_proj":
            return 1, self.rank * self.intermediate_size, self.intermediate_size
        raise ValueError(f"{module!r} is not a decoder projection")

    def shard_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of dense checkpoint tensor ``name`` (full shape already checked),
        in the shape the local config's target expects; tensors every rank needs whole (norms,
        KV scales) come back unchanged."""
        match = _PIECE.search(name)
        if match is None:
            return tensor
        piece = match.group("piece")
        if piece is not None:
            module, kind = piece.split(".")
            dim, start, length = self.projection_slice(module)
            return _narrow(tensor, 0 if kind == "bias" else dim, start, length)
        # embed_tokens / lm_head: vocabulary rows, the last rank's padding zero
        rows = min(self.vocab_rows, max(0, self.config.vocab_size - self.vocab_start))
        out = tensor.new_zeros((self.vocab_rows, *tensor.shape[1:]))
        out[:rows].copy_(tensor[self.vocab_start : self.vocab_start + rows])
        return out


_PIECE = re.compile(
    r"(?:self_attn|mlp)\.(?P<piece>[qkvo]_proj\.(?:weight|bias)|(?:gate|up|down)_proj\.weight)$"
    r"|(?:^model\.embed_tokens\.weight|^lm_head\.weight)$"
)


def _narrow(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(dim, start, length).contiguous()
