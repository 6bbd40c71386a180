"""Block manager: reference counts, deterministic chained hashes, LRU revival/eviction, usage."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve_contract.block_hash import hash_token_blocks
from splitserve_runtime.engine.block_manager import BlockManager
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.sequence import Sequence

BS = 4


def _seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(
        request_id=request_id, token_ids=list(token_ids), num_prompt_tokens=len(token_ids), params=SamplingParams()
    )


def _admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit like the scheduler does: prefix lookup, then allocate the rest; returns hits."""
    hits = bm.lookup_prefix(seq)
    bm.take_cached_prefix(seq=seq, cached_block_ids=hits)
    assert bm.allocate_slots(seq=seq, num_new_tokens=seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return len(hits)


def test_allocate_and_free_restore_free_count() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = _seq("a", list(range(10)))  # 3 blocks
    assert bm.allocate_slots(seq=seq, num_new_tokens=10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage_ratio == pytest.approx(3 / 8)
    # growing within the last block allocates nothing; crossing a boundary allocates one
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq=seq, num_new_tokens=2)
    assert bm.num_free_blocks == 5
    assert bm.allocate_slots(seq=seq, num_new_tokens=3)
    assert bm.num_free_blocks == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage_ratio == 0.0
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_allocate_fails_without_change_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    seq = _seq("a", list(range(12)))
    assert not bm.allocate_slots(seq=seq, num_new_tokens=12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert not bm.can_allocate(seq=seq, num_new_tokens=12)
    assert bm.can_allocate(seq=seq, num_new_tokens=8)


def test_shared_prefix_refcounts_and_last_token_never_cached() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = _seq("a", list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert _admit(bm, a) == 0
    assert bm.num_cached_blocks == 2
    b = _seq("b", list(range(8)) + [99, 98, 97])
    assert _admit(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 11
    for block_id in a.block_table[:2]:
        assert bm.ref_count(block_id) == 2
    assert bm.ref_count(a.block_table[2]) == 1
    # a prompt that is exactly the cached blocks re-computes its last block
    c = _seq("c", list(range(8)))
    assert bm.lookup_prefix(c) == a.block_table[:1]
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.usage_ratio == 0.0


def test_freed_blocks_stay_cached_and_revive_then_lru_evicts_oldest() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = _seq("a", [1, 1, 1, 1, 2])  # one full block
    _admit(bm, a)
    a_block = a.block_table[0]
    bm.free(a)
    b = _seq("b", [3, 3, 3, 3, 4])
    _admit(bm, b)
    b_block = b.block_table[0]
    bm.free(b)
    # cached-but-free blocks count as free
    assert bm.num_free_blocks == 4 and bm.usage_ratio == 0.0 and bm.num_cached_blocks == 2
    # revival: the same prefix hits the freed block
    a2 = _seq("a2", [1, 1, 1, 1, 5])
    assert _admit(bm, a2) == 1 and a2.block_table[0] == a_block
    bm.free(a2)
    # now 'b' is least recently used: a 3-block request evicts hashless blocks first, then b's
    big = _seq("big", [7] * 12)
    bm.allocate_slots(seq=big, num_new_tokens=12)
    assert a_block not in big.block_table
    assert b_block in big.block_table
    assert bm.lookup_prefix(_seq("b2", [3, 3, 3, 3, 4])) == []
    assert bm.lookup_prefix(_seq("a3", [1, 1, 1, 1, 6])) == [a_block]


def test_tail_blocks_are_evicted_before_head_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = _seq("a", list(range(12)))  # 3 full blocks
    bm.allocate_slots(seq=a, num_new_tokens=12)
    a.num_computed_tokens = 12
    bm.commit(a)
    head, mid, tail = a.block_table
    bm.free(a)
    other = _seq("o", [9] * 4)
    bm.allocate_slots(seq=other, num_new_tokens=4)
    assert other.block_table == [tail]
    probe = _seq("p", list(range(12)) + [1])
    assert bm.lookup_prefix(probe) == [head, mid]


def test_usage_ratio_counts_only_live_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = _seq("a", list(range(9))), _seq("b", list(range(100, 109)))
    _admit(bm, a)
    _admit(bm, b)
    assert bm.usage_ratio == pytest.approx(6 / 10)
    bm.free(a)
    assert bm.usage_ratio == pytest.approx(3 / 10)
    assert bm.num_cached_blocks == 4


def test_import_hooks_allocate_known_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    donor = _seq("d", list(range(9)))
    _admit(bm, donor)
    seq = _seq("x", list(range(8)) + [42, 43, 44])
    assert bm.block_hashes_of(seq)[:2] == bm.block_hashes_of(donor)[:2]
    num_cached = bm.allocate_for_known_prefix(seq=seq, num_tokens=10)
    assert num_cached == 8 and len(seq.block_table) == 3
    bm.mark_computed(seq=seq, num_tokens=10)
    assert seq.num_computed_tokens == 10
    assert bm.allocate_for_known_prefix(seq=_seq("y", list(range(40))), num_tokens=40) is None
    with pytest.raises(ValueError):
        bm.allocate_for_known_prefix(seq=_seq("z", [1]), num_tokens=5)


def test_block_hashes_are_identical_in_another_process() -> None:
    tokens = list(range(1000, 1037))
    here = [h.hex() for h in hash_token_blocks(token_ids=tokens, block_size=16)]
    code = (
        "from splitserve_contract.block_hash import hash_token_blocks;"
        f"print(','.join(h.hex() for h in hash_token_blocks(token_ids={tokens!r}, block_size=16)))"
    )
    there = (
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": "12345", "PATH": ""},
        )
        .stdout.strip()
        .split(",")
    )
    assert len(here) == 2 and here == there
    # the chain: the same block content after a different prefix hashes differently
    other = hash_token_blocks(token_ids=[0] * 16 + tokens[16:32], block_size=16)
    assert other[1].hex() != here[1]
    # the manager's per-sequence hashes are the same function
    bm = BlockManager(num_blocks=4, block_size=16, enable_prefix_caching=True)
    assert [h.hex() for h in bm.block_hashes_of(_seq("s", tokens))] == here


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0, enable_prefix_caching=True)


def test_pinned_blocks_survive_free_until_unpinned() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    seq = _seq("p", list(range(8)))
    assert bm.allocate_slots(seq=seq, num_new_tokens=8)
    blocks = list(seq.block_table)
    bm.pin_blocks(blocks)
    bm.free(seq)
    assert bm.num_free_blocks == 2 and bm.usage_ratio == 0.5
    bm.unpin_blocks(blocks)
    assert bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="only held blocks"):
        bm.pin_blocks(blocks)
    with pytest.raises(RuntimeError):
        bm.unpin_blocks(blocks)
