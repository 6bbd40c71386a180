"""The process group of one tensor-parallel model, and the collectives the model needs.

NCCL between GPUs and gloo on CPU; every rank calls the same collectives in the same order
(the model's forward is identical on every rank), so the model needs only two: a sum of
partial outputs after each row-parallel projection and the embedding, and a gather of the
vocabulary slices of the logits. Host-side messages (each step's batch, KV block reads and
writes) go over a separate gloo group (:meth:`TensorParallelGroup.broadcast_object`), so they
never queue behind device work.

The groups are c10d backends built on their own ``TCPStore`` rather than ``torch.distributed``'s
process-global default group: nothing in the process is global, so one process may hold two
engines (a test moving KV between a TP 2 and a TP 1 engine does) and a library user's own
default group is left alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
from typing import Any
from urllib.parse import urlparse

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others to join (they load weights after joining, not before)."""


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the group: its rank, the group size, its device, its backends."""

    rank: int
    size: int
    device: torch.device
    devices: Any
    """The backend of device tensors (NCCL on GPU; the gloo one on CPU)."""
    control: Any
    """A gloo backend over the same ranks for host-side messages."""
    store: Store

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and serves."""
        return self.rank == 0

    # ------------------------------------------------------------------ the model's collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        self.devices.allreduce([tensor]).wait()
        return tensor

    def gather_vocab(self, local: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
        """The full ``[n, vocab_size]`` logits from each rank's ``[n, vocab_rows]`` slice (every
        rank gets them; only rank 0 samples)."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.devices.allgather([parts], [local]).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ------------------------------------------------------------------ host-side messages
    def broadcast_object(self, obj: object = None) -> Any:
        """Rank 0's ``obj``, on every rank (pickled; rank 0 passes it, the others None)."""
        if self.is_driver:
            data = pickle.dumps(obj)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver
                  else torch.empty(int(size.item()), dtype=torch.uint8))
        self.control.broadcast(buffer, 0).wait()
        return obj if self.is_driver else pickle.loads(buffer.numpy().tobytes())

    def all_gather_object(self, obj: object) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.control.allgather([sizes], [size]).wait()
        longest = max(int(s.item()) for s in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.control.allgather([parts], [buffer]).wait()
        return [pickle.loads(part[:int(n.item())].numpy().tobytes()) for part, n in zip(parts, sizes, strict=True)]


def init_group(*, rank: int, size: int, init_method: str, device: torch.device) -> TensorParallelGroup:
    """Join the group at ``init_method`` (``tcp://host:port``; rank 0 listens there)."""
    address = urlparse(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"init method must be tcp://host:port, got {init_method!r}")
    store = TCPStore(address.hostname, address.port, world_size=size, is_master=rank == 0, timeout=INIT_TIMEOUT)
    control = ProcessGroupGloo(PrefixStore("control", store), rank, size, INIT_TIMEOUT)
    devices: Any
    if device.type == "cuda":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        torch.cuda.set_device(device)
        devices = ProcessGroupNCCL(PrefixStore("nccl", store), rank, size, ProcessGroupNCCL.Options())
        backend = "nccl"
    else:
        devices = ProcessGroupGloo(PrefixStore("devices", store), rank, size, INIT_TIMEOUT)
        backend = "gloo"
    log.info("tensor-parallel rank %d/%d joined (%s on %s)", rank, size, backend, device)
    return TensorParallelGroup(rank=rank, size=size, device=device, devices=devices, control=control, store=store)
