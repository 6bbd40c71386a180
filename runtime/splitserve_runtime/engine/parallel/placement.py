"""Where the ranks of one replica run: all in one pod, or spread over a group of pods.

A model too big for one node is served by a *group* of ``nnodes`` pods (a LeaderWorkerSet
group: the controller gives every pod ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and
``LWS_WORKER_INDEX``). Each pod holds ``g = tensor × pipeline / nnodes`` consecutive ranks in
the usual stage-major order: pod ``k`` holds ranks ``k·g … (k+1)·g − 1`` and numbers its devices
from 0. Node 0, the *leader*, is what a one-pod replica is today (HTTP server, engine = rank 0,
its other ranks as child processes) and hosts the rendezvous store on ``rendezvous_port``;
the other pods run only their ranks and join at ``leader_address:rendezvous_port``.

Resolving the placement is pure (flags and environment in, a checked :class:`Placement` or a
:class:`PlacementError` saying what to fix out) and imports no torch, so ``splitserve serve``
refuses a bad combination before it listens or loads anything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from splitserve_contract import ServeArgs

ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
ENV_WORKER_INDEX = "LWS_WORKER_INDEX"


class PlacementError(ValueError):
    """The flags and environment do not describe a group this process can take part in."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """This pod's place in its replica's group (one pod: ``nnodes == 1``, ``node_rank == 0``)."""

    nnodes: int
    node_rank: int
    world_size: int
    """All ranks of the replica: tensor × pipeline."""
    leader_address: str
    rendezvous_port: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def is_leader(self) -> bool:
        """Node 0: serves the API and drives the other ranks."""
        return self.node_rank == 0

    @property
    def is_multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def local_ranks(self) -> range:
        """The global ranks this pod holds."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        """``rank``'s position among its pod's ranks (its device index there)."""
        return rank % self.ranks_per_node

    def remote_nodes(self) -> range:
        """The pods other than the leader."""
        return range(1, self.nnodes)

    def init_method(self) -> str:
        """Where this pod's ranks meet the group's store (``--nnodes`` > 1): the leader's own
        ranks over loopback (a keyed group's store listens on every interface; a keyless one's
        only on its loopback leader address, :mod:`.rendezvous`), the others at the leader."""
        if not self.is_multinode:
            raise ValueError("a one-pod replica meets on a free loopback port, not the rendezvous port")
        host = "127.0.0.1" if self.is_leader else self.leader_address
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        return f"tcp://{host}:{self.rendezvous_port}"

    def describe_node(self, node: int) -> str:
        ranks = range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
        span = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        return f"node {node} (rank{'s' if len(ranks) > 1 else ''} {span})"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise PlacementError(f"${name} must be an integer, got {raw!r}") from None


def resolve_placement(args: ServeArgs, env: Mapping[str, str] | None = None) -> Placement:
    """This pod's placement from ``args``, falling back to the LeaderWorkerSet environment
    (``env``: the process environment unless given)."""
    env = os.environ if env is None else env
    nnodes = args.nnodes
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    if nnodes < 1:
        raise PlacementError(f"--nnodes must be at least 1, got {nnodes}")
    if world_size < 1:
        raise PlacementError(f"--tensor-parallel-size × --pipeline-parallel-size must be at least 1, got {world_size}")
    group_size = _env_int(env, ENV_GROUP_SIZE)
    if group_size is not None and group_size != nnodes:
        raise PlacementError(
            f"${ENV_GROUP_SIZE}={group_size} (pods in this LeaderWorkerSet group) but --nnodes "
            f"{nnodes}: render --nnodes {group_size}, or leaderWorkerTemplate.size {nnodes}"
        )
    if nnodes > 1 and world_size % nnodes:
        raise PlacementError(
            f"--nnodes {nnodes} must divide tensor × pipeline = {args.tensor_parallel_size} × "
            f"{args.pipeline_parallel_size} = {world_size}: every pod holds the same number of ranks"
        )
    node_rank = args.node_rank
    if node_rank < -1:
        raise PlacementError(f"--node-rank must be -1 (from ${ENV_WORKER_INDEX}) or at least 0, got {node_rank}")
    if node_rank == -1:
        from_env = _env_int(env, ENV_WORKER_INDEX)
        node_rank = 0 if from_env is None else from_env
        if node_rank < 0:
            raise PlacementError(f"${ENV_WORKER_INDEX} must be at least 0, got {node_rank}")
    if node_rank >= nnodes:
        raise PlacementError(f"node rank {node_rank} is outside a group of --nnodes {nnodes} pods")
    leader_address = (args.leader_address or env.get(ENV_LEADER_ADDRESS, "")).strip()
    if node_rank > 0 and not leader_address:
        raise PlacementError(
            f"node rank {node_rank} joins its group's leader, but neither --leader-address "
            f"nor ${ENV_LEADER_ADDRESS} names it"
        )
    if not 0 < args.rendezvous_port < 65536:
        raise PlacementError(f"--rendezvous-port must be a TCP port (1-65535), got {args.rendezvous_port}")
    return Placement(
        nnodes=nnodes,
        node_rank=node_rank,
        world_size=world_size,
        leader_address=leader_address,
        rendezvous_port=args.rendezvous_port,
    )


def pin(args: ServeArgs, placement: Placement) -> ServeArgs:
    """``args`` with the placement written out, so a child process needs no environment."""
    return dataclasses.replace(args, node_rank=placement.node_rank, leader_address=placement.leader_address)
