"""Prefill/decode selection: prefix affinity weighed against load, sessions, fallbacks."""

from __future__ import annotations

import subprocess
import sys

from splitserve_contract import RoutingPolicy
from splitserve_runtime.router.policy import (
    Candidate,
    PodLoad,
    PrefillSelector,
    choose_decode,
    prefix_block_hashes,
)

PODS = [Candidate(name=f"p{i}") for i in range(3)]


def test_block_hashes_are_chained_and_deterministic_across_processes() -> None:
    tokens = list(range(40))
    hashes = prefix_block_hashes(tokens, block_size=16)
    assert len(hashes) == 2  # the partial third block is not hashed
    other = prefix_block_hashes([99, *tokens[1:]], block_size=16)
    assert other[0] != hashes[0] and other[1] != hashes[1]  # a change in block 0 changes block 1
    code = (
        "from splitserve_runtime.router.policy import prefix_block_hashes;"
        "print(prefix_block_hashes(list(range(40)), block_size=16)[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashes[1].hex()


def test_repeated_prefix_goes_to_the_pod_that_saw_it() -> None:
    selector = PrefillSelector(policy=RoutingPolicy.PREFIX_AFFINITY)
    system = list(range(64))
    first = selector.choose(candidates=PODS, hashes=prefix_block_hashes(system + [1000], block_size=16), session=None)
    assert first is not None and first.matched_blocks == 0
    selector.record(pod=first.pod, hashes=prefix_block_hashes(system, block_size=16))
    again = selector.choose(
        candidates=PODS, hashes=prefix_block_hashes(system + [2000, 2001], block_size=16), session=None
    )
    assert again is not None and again.pod == first.pod and again.matched_blocks == 4 and again.reason == "PrefixHit"


def test_distinct_prefixes_spread_over_pods() -> None:
    selector = PrefillSelector(policy=RoutingPolicy.PREFIX_AFFINITY)
    chosen = set()
    for group in range(30):
        hashes = prefix_block_hashes([group * 1000 + i for i in range(32)], block_size=16)
        choice = selector.choose(candidates=PODS, hashes=hashes, session=None)
        assert choice is not None
        chosen.add(choice.pod)
    assert chosen == {"p0", "p1", "p2"}


def test_load_outweighs_affinity_when_the_cached_pod_is_busy() -> None:
    selector = PrefillSelector(policy=RoutingPolicy.PREFIX_AFFINITY, load_penalty_blocks=1.0)
    hashes = prefix_block_hashes(list(range(32)), block_size=16)  # 2 blocks
    selector.record(pod="p0", hashes=hashes)
    busy = [Candidate(name="p0", load=PodLoad(requests_waiting=5)), Candidate(name="p1")]
    choice = selector.choose(candidates=busy, hashes=hashes, session=None)
    assert choice is not None and choice.pod == "p1"
    idle = [Candidate(name="p0"), Candidate(name="p1")]
    choice = selector.choose(candidates=idle, hashes=hashes, session=None)
    assert choice is not None and choice.pod == "p0"


def test_session_header_pins_and_unpins_when_pod_leaves() -> None:
    selector = PrefillSelector(policy=RoutingPolicy.LEAST_LOAD)
    loaded = [Candidate(name="p0"), Candidate(name="p1", load=PodLoad(requests_waiting=3))]
    first = selector.choose(candidates=loaded, hashes=[], session="chat-1")
    assert first is not None and first.pod == "p0"
    # p0 becomes busier, but the session stays.
    loaded = [Candidate(name="p0", load=PodLoad(requests_waiting=9)), Candidate(name="p1")]
    again = selector.choose(candidates=loaded, hashes=[], session="chat-1")
    assert again is not None and again.pod == "p0" and again.reason == "Session"
    # p0 goes away: the session moves.
    moved = selector.choose(candidates=[Candidate(name="p1")], hashes=[], session="chat-1")
    assert moved is not None and moved.pod == "p1"


def test_round_robin_and_exclusion() -> None:
    selector = PrefillSelector(policy=RoutingPolicy.ROUND_ROBIN)
    picks = [selector.choose(candidates=PODS, hashes=[], session=None) for _ in range(6)]
    assert [p.pod for p in picks if p] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    none_left = selector.choose(candidates=PODS, hashes=[], session=None, exclude=frozenset({"p0", "p1", "p2"}))
    assert none_left is None


def test_decode_choice_prefers_kv_headroom_then_queue() -> None:
    pods = [
        Candidate(name="d0", load=PodLoad(kv_cache_usage_ratio=0.9)),
        Candidate(name="d1", load=PodLoad(kv_cache_usage_ratio=0.2, requests_waiting=1)),
        Candidate(name="d2", load=PodLoad(kv_cache_usage_ratio=0.2)),
    ]
    assert choose_decode(candidates=pods) == "d2"
    assert choose_decode(candidates=pods, exclude=frozenset({"d2"})) == "d1"
    assert choose_decode(candidates=[]) is None
