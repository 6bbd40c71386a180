"""The process group of one tensor-parallel model, and the collectives the model needs.

``torch.distributed`` with NCCL between GPUs and gloo on CPU; every rank calls the same
collectives in the same order (the model's forward is identical on every rank), so the
model only needs two: a sum of partial outputs after each row-parallel projection and the
embedding, and a gather of the vocabulary slices of the logits. Control messages (each step's
batch, KV block reads and writes) go over a separate gloo group on the host
(:mod:`.control`), so they never queue behind device work.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others to join (they load weights after joining, not before)."""


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the group: its rank, the group size, its device."""

    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup
    """A gloo group over the same ranks for host-side messages."""

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and serves."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def gather_vocab(self, local: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
        """The full ``[n, vocab_size]`` logits from each rank's ``[n, vocab_rows]`` slice (every
        rank gets them; only rank 0 samples)."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def init_group(*, rank: int, size: int, init_method: str, device: torch.device) -> TensorParallelGroup:
    """Join the group at ``init_method`` (``tcp://host:port``, rank 0 listening)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=INIT_TIMEOUT)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    assert control is not None
    log.info("tensor-parallel rank %d/%d joined (%s on %s)", rank, size, backend, device)
    return TensorParallelGroup(rank=rank, size=size, device=device, control=control)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
