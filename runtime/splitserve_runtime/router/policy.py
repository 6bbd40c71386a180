"""Choosing pods: prefix affinity for prefill, KV headroom for decode. Pure, no I/O.

Prefix affinity: a prompt is cut into blocks of `block_size` tokens and each full leading block
gets a chained hash (a block's hash covers every token before it, like the engine's prefix
cache). The router remembers, per prefill pod, the block hashes it recently sent there (a
bounded LRU). A new prompt scores each pod by how many of its leading blocks that pod has seen,
weighed against the pod's load, so a shared system prompt keeps landing where its KV is cached
until that pod is busy enough that queueing there costs more than recomputing elsewhere. With
no history yet, rendezvous hashing on the first block spreads distinct prefixes and keeps equal
ones together. A session header pins a chat session to one pod while that pod stays healthy.

Decode: the pod with the most KV headroom and the shortest queue wins; for a prompt the decode
pod computes itself (short, overflowed, prefill failed), prefix affinity within a small slack
of that headroom, recorded in the same index (each pod has its own entries).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitserve_contract import RoutingPolicy
from splitserve_contract.block_hash import hash_token_blocks

MAX_AFFINITY_BLOCKS = 32
"""Leading blocks considered for affinity; beyond that the tail of a prompt rarely matters."""


@dataclass
class PodLoad:
    """The last load figures read from a pod's /metrics, plus the router's own in-flight count."""

    requests_waiting: float = 0.0
    requests_running: float = 0.0
    kv_cache_usage_ratio: float = 0.0
    prompt_tokens_waiting: float | None = 0.0
    """Uncached prompt tokens queued on the pod (its ``splitserve_prompt_tokens_waiting``);
    None where the engine exports no such gauge (vLLM counts its backlog in requests only)."""
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    """Prompt tokens of the prefill requests this router has sent the pod and not had answered."""

    @property
    def queue(self) -> float:
        return max(self.requests_waiting, 0.0) + self.in_flight

    @property
    def queued_prompt_tokens(self) -> float:
        """Prompt tokens ahead of a new prefill: the larger of the pod's own count (every
        router's requests, as of the last poll) and this router's in-flight ones (immediate).
        A pod whose engine keeps no count has this router's alone: an estimate low by other
        routers' requests, the best a router can know without the pod's own figure."""
        return max(self.prompt_tokens_waiting or 0.0, 0.0, float(self.in_flight_prompt_tokens))


@dataclass
class Candidate:
    name: str
    load: PodLoad = field(default_factory=PodLoad)


def prefix_block_hashes(
    token_ids: Sequence[int], *, block_size: int, max_blocks: int = MAX_AFFINITY_BLOCKS
) -> list[bytes]:
    """Chained hashes of the full leading blocks of `token_ids`: the engine's prefix-cache
    hash (:mod:`splitserve_contract.block_hash`), capped at ``max_blocks``."""
    return hash_token_blocks(token_ids=token_ids, block_size=block_size, max_blocks=max_blocks)


class AffinityIndex:
    """Per pod, an LRU set of block hashes recently routed there."""

    def __init__(self, *, capacity_per_pod: int = 4096) -> None:
        self._capacity = capacity_per_pod
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, *, pod: str, hashes: Sequence[bytes]) -> None:
        seen = self._seen.setdefault(pod, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self._capacity:
            seen.popitem(last=False)

    def matched_blocks(self, *, pod: str, hashes: Sequence[bytes]) -> int:
        seen = self._seen.get(pod)
        if not seen:
            return 0
        return sum(1 for _ in itertools.takewhile(lambda h: h in seen, hashes))

    def forget(self, pod: str) -> None:
        self._seen.pop(pod, None)


@dataclass(frozen=True)
class Choice:
    pod: str
    matched_blocks: int
    reason: str


def _rendezvous(pod: str, key: bytes) -> bytes:
    return hashlib.blake2b(key + pod.encode(), digest_size=8).digest()


class PrefillSelector:
    """Picks a prefill pod under one of the RoutingPolicy values."""

    def __init__(self, *, policy: RoutingPolicy, load_penalty_blocks: float = 4.0) -> None:
        self._policy = policy
        self._load_penalty_blocks = load_penalty_blocks
        self._round_robin = itertools.count()
        self.index = AffinityIndex()
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(
        self,
        *,
        candidates: Sequence[Candidate],
        hashes: Sequence[bytes],
        session: str | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Choice | None:
        pods = [c for c in candidates if c.name not in exclude]
        if not pods:
            return None
        by_name = {c.name: c for c in pods}
        if session and session in self._sessions and self._sessions[session] in by_name:
            pod = self._sessions[session]
            self._sessions.move_to_end(session)
            return Choice(pod=pod, matched_blocks=self.index.matched_blocks(pod=pod, hashes=hashes), reason="Session")
        if self._policy is RoutingPolicy.ROUND_ROBIN:
            pod = pods[next(self._round_robin) % len(pods)].name
            choice = Choice(
                pod=pod, matched_blocks=self.index.matched_blocks(pod=pod, hashes=hashes), reason="RoundRobin"
            )
        elif self._policy is RoutingPolicy.LEAST_LOAD or not hashes:
            pod = min(pods, key=lambda c: (c.load.queue, c.load.requests_running, c.name)).name
            choice = Choice(
                pod=pod, matched_blocks=self.index.matched_blocks(pod=pod, hashes=hashes), reason="LeastLoad"
            )
        else:
            choice = self._by_affinity(pods=pods, hashes=hashes)
        if session:
            self._sessions[session] = choice.pod
            while len(self._sessions) > 65536:
                self._sessions.popitem(last=False)
        return choice

    def _by_affinity(self, *, pods: Sequence[Candidate], hashes: Sequence[bytes]) -> Choice:
        def score(c: Candidate) -> tuple[float, bytes]:
            matched = self.index.matched_blocks(pod=c.name, hashes=hashes)
            # A queued request costs about `load_penalty_blocks` blocks of recompute.
            value = matched - self._load_penalty_blocks * c.load.queue
            return value, _rendezvous(c.name, hashes[0])

        best = max(pods, key=score)
        matched = self.index.matched_blocks(pod=best.name, hashes=hashes)
        return Choice(pod=best.name, matched_blocks=matched, reason="PrefixHit" if matched else "PrefixMiss")

    def record(self, *, pod: str, hashes: Sequence[bytes]) -> None:
        self.index.record(pod=pod, hashes=hashes)

    def forget(self, pod: str) -> None:
        self.index.forget(pod)
        for session in [s for s, p in self._sessions.items() if p == pod]:
            del self._sessions[session]


DECODE_AFFINITY_SLACK = 0.1
"""How much more pressure (KV usage ratio + 0.1 per queued request) a decode pod that computes a
prompt itself may carry than the least pressed one and still win on cached prefix blocks: its
prefix cache saves recomputing them, and the slack keeps affinity from piling onto a full pod."""


def _pressure(c: Candidate) -> float:
    return c.load.kv_cache_usage_ratio + 0.1 * c.load.queue


def choose_decode(
    *,
    candidates: Sequence[Candidate],
    exclude: frozenset[str] = frozenset(),
    matched_blocks: Callable[[str], int] | None = None,
) -> str | None:
    """The decode pod with the most KV headroom, then the shortest queue. With ``matched_blocks``
    (a prompt the decode pod computes itself: short, overflowed, or its prefill failed), the pod
    within :data:`DECODE_AFFINITY_SLACK` of that with the most of the prompt's leading blocks
    routed to it before wins instead."""
    pods = [c for c in candidates if c.name not in exclude]
    if not pods:
        return None
    best = min(pods, key=lambda c: (_pressure(c), c.load.requests_running, c.name))
    if matched_blocks is None:
        return best.name
    near = [c for c in pods if _pressure(c) <= _pressure(best) + DECODE_AFFINITY_SLACK]
    cached = max(near, key=lambda c: (matched_blocks(c.name), -_pressure(c), -c.load.requests_running))
    return cached.name if matched_blocks(cached.name) > 0 else best.name
