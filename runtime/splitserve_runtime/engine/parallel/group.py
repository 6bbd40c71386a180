"""The process group of one parallel model, and the communication it needs.

``tp_size × num_stages`` ranks: rank ``stage * tp_size + tp_rank``. NCCL between GPUs and gloo
on CPU. Within a pipeline stage the tensor-parallel ranks call the same collectives in the same
order (their forward is identical), so the model needs only two: a sum of partial outputs
after each row-parallel projection and the embedding, and a gather of the vocabulary slices of
the logits. Between stages, each tensor-parallel rank sends its stage's output to the same
rank of the next stage over a two-rank link, and the last stage's first rank sends the logits
back to the driver (:mod:`.pipeline`). Host-side messages (each step's batch, KV block reads
and writes) go over a separate gloo group of all ranks
(:meth:`ParallelGroup.broadcast_object`), so they never queue behind device work.

The groups are c10d backends built on their own ``TCPStore`` rather than ``torch.distributed``'s
process-global default group: nothing in the process is global, so one process may hold two
engines (a test moving KV between a TP 2 and a TP 1 engine does) and a library user's own
default group is left alone.

Where the group's sockets listen and how its control messages are authenticated (a one-pod
replica on loopback only; every message MAC'd under the group's key and checked before it is
unpickled) is :mod:`.rendezvous`'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import socket
from typing import Any
from urllib.parse import urlparse

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from .rendezvous import ControlCodec, Rendezvous

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others to join (they load weights after joining, not before)."""


@dataclasses.dataclass(frozen=True)
class ParallelGroup:
    """This process's place in the group: its ranks, its device, its backends."""

    rank: int
    size: int
    tp_rank: int
    tp_size: int
    stage: int
    num_stages: int
    device: torch.device
    devices: Any
    """The backend of this stage's tensor-parallel ranks (NCCL on GPU, gloo on CPU; None at
    TP 1)."""
    control: Any
    """A gloo backend over all ranks for host-side messages."""
    store: Store
    codec: ControlCodec
    """Seals and opens this member's control messages (:mod:`.rendezvous`)."""
    prev_link: Any = None
    """Two ranks: the same tensor-parallel rank of the previous stage (0) and this one (1)."""
    next_link: Any = None
    """Two ranks: this one (0) and the same tensor-parallel rank of the next stage (1)."""
    logits_link: Any = None
    """Two ranks: the driver (0) and the last stage's first tensor-parallel rank (1)."""

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and serves."""
        return self.rank == 0

    # ------------------------------------------------------------------ the model's collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over this stage's tensor-parallel ranks, in place; returns it."""
        if self.devices is not None:
            self.devices.allreduce([tensor]).wait()
        return tensor

    def gather_vocab(self, local: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
        """The full ``[n, vocab_size]`` logits from each rank's ``[n, vocab_rows]`` slice (every
        rank gets them; only rank 0 samples)."""
        local = local.contiguous()
        if self.devices is None:
            return local[:, :vocab_size]
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        self.devices.allgather([parts], [local]).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ------------------------------------------------------------------ host-side messages
    def broadcast_object(self, obj: object = None) -> Any:
        """Rank 0's ``obj``, on every rank (pickled and sealed; rank 0 passes it, the others
        None). A receiver checks the MAC before it unpickles (:class:`~.rendezvous.ControlAuthError`)."""
        sequence = self.codec.next_sequence()
        if self.is_driver:
            data = self.codec.seal(pickle.dumps(obj), sender=0, sequence=sequence)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        if int(size.item()) < 0:
            raise RuntimeError(f"the parallel driver announced a control message of {int(size.item())} bytes")
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.is_driver
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        self.control.broadcast(buffer, 0).wait()
        if self.is_driver:
            return obj
        return pickle.loads(self.codec.open(buffer.numpy().tobytes(), sender=0, sequence=sequence))

    def all_gather_object(self, obj: object) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (each checked before it is unpickled)."""
        sequence = self.codec.next_sequence()
        data = self.codec.seal(pickle.dumps(obj), sender=self.rank, sequence=sequence)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.control.allgather([sizes], [size]).wait()
        longest = max(int(s.item()) for s in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.control.allgather([parts], [buffer]).wait()
        out: list[Any] = []
        for sender, (part, n) in enumerate(zip(parts, sizes, strict=True)):
            if sender == self.rank:
                out.append(obj)
                continue
            length = int(n.item())
            if not 0 <= length <= longest:
                raise RuntimeError(f"rank {sender} announced a control message of {length} bytes")
            out.append(pickle.loads(self.codec.open(part[:length].numpy().tobytes(), sender=sender, sequence=sequence)))
        return out


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (the store's own listener binds every
    interface; given this one's descriptor, it serves here instead)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def _store(*, host: str, port: int, rank: int, size: int, rendezvous: Rendezvous) -> TCPStore:
    """Rank 0 hosts the group's store (on ``rendezvous.store_host`` when it names one), the
    others connect to it at ``host:port``."""
    if rank != 0 or rendezvous.store_host is None:
        return TCPStore(host, port, world_size=size, is_master=rank == 0, timeout=INIT_TIMEOUT)
    listener = _listening_socket(rendezvous.store_host, port)
    try:
        store = TCPStore(
            host, port, world_size=size, is_master=True, timeout=INIT_TIMEOUT, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store serves on this very descriptor from now on
    return store


def _gloo(store: Store, member: int, members: int, *, loopback: bool) -> Any:
    """A gloo backend; on a group of one machine its connections listen on loopback (gloo's
    default is the address this host's name resolves to: the pod's IP in a cluster)."""
    if not loopback:
        return ProcessGroupGloo(store, member, members, INIT_TIMEOUT)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the binding's name; the stubs lag
    options._timeout = INIT_TIMEOUT
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(store, member, members, options)


def init_group(
    *, rank: int, tp_size: int, num_stages: int, init_method: str, device: torch.device, rendezvous: Rendezvous
) -> ParallelGroup:
    """Join the group at ``init_method`` (``tcp://host:port``; rank 0 listens there, or where
    ``rendezvous`` says). Every rank builds its backends in the same global order, so no two
    ranks wait on each other."""
    address = urlparse(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"init method must be tcp://host:port, got {init_method!r}")
    size = tp_size * num_stages
    stage, tp_rank = divmod(rank, tp_size)
    if device.type == "cuda" and rendezvous.loopback:  # NCCL's bootstrap sockets: this machine only
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = _store(host=address.hostname, port=address.port, rank=rank, size=size, rendezvous=rendezvous)
    control = _gloo(PrefixStore("control", store), rank, size, loopback=rendezvous.loopback)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def backend(prefix: str, member: int, members: int) -> Any:
        scoped = PrefixStore(prefix, store)
        if device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            return ProcessGroupNCCL(scoped, member, members, ProcessGroupNCCL.Options())
        return _gloo(scoped, member, members, loopback=rendezvous.loopback)

    devices = backend(f"tp{stage}", tp_rank, tp_size) if tp_size > 1 else None
    prev_link = backend(f"pp{stage - 1}.{tp_rank}", 1, 2) if stage > 0 else None
    next_link = backend(f"pp{stage}.{tp_rank}", 0, 2) if stage < num_stages - 1 else None
    logits_link = None
    if num_stages > 1 and rank == 0:
        logits_link = backend("logits", 0, 2)
    elif num_stages > 1 and stage == num_stages - 1 and tp_rank == 0:
        logits_link = backend("logits", 1, 2)
    log.info(
        "parallel rank %d/%d joined (stage %d/%d, tensor rank %d/%d, %s on %s)",
        rank,
        size,
        stage,
        num_stages,
        tp_rank,
        tp_size,
        "nccl" if device.type == "cuda" else "gloo",
        device,
    )
    return ParallelGroup(
        rank=rank,
        size=size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        stage=stage,
        num_stages=num_stages,
        device=device,
        devices=devices,
        control=control,
        store=store,
        codec=ControlCodec(rendezvous.key),
        prev_link=prev_link,
        next_link=next_link,
        logits_link=logits_link,
    )
