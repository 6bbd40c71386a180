"""KV cache block accounting: a free list, reference counts and a prefix cache.

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A sequence
owns a *block table* (list of block ids). Blocks are shared between sequences through
reference counts.

Prefix caching (as in vLLM and nano-vllm): every *full* block is identified by a chained
hash ``H(parent_hash, token ids of the block)``, so equal hashes mean equal prefixes. The
hash is :mod:`splitserve_contract.block_hash` (BLAKE2b over fixed-width bytes, identical
across processes and hosts), the same function the router's prefix affinity uses, which lets a
router or a decode pod name blocks computed elsewhere (:meth:`BlockManager.block_hashes_of`).

A freed block keeps its hash and stays findable until it is reused. Free blocks are kept in
LRU order: hashless blocks go to the front (reused first), hashed ones to the back, and a
sequence frees its blocks tail first, so a prompt's head outlives its tail. A cache hit on a
free block revives it. ``usage_ratio`` counts only blocks held by live sequences: cached but
free blocks are free (``docs/architecture.md``, "Metrics").

Every change to a block table is mirrored in :attr:`BlockManager.tables` (one int32 row per
sequence, :mod:`.block_tables`), from which the runner gathers a step's tables in one copy.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve_contract.block_hash import hash_block, root_block_hash

from .block_tables import BlockTables
from .sequence import Sequence


class NoFreeBlocks(RuntimeError):
    """Raised by the internal pop when the free list is empty (callers check first)."""


class BlockManager:
    """Owns block ids, reference counts and the hash -> block index of the prefix cache."""

    def __init__(
        self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool, hash_salt: bytes = b""
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = root_block_hash(salt=hash_salt)
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Free blocks in reuse order (front = next to reuse); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.tables = BlockTables()
        """Every held block table as an int32 row (``seq.block_row``)."""

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds (including cached-but-free ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache (held or free)."""
        return len(self._hash_to_block)

    @property
    def usage_ratio(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes_of(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of ``seq``'s full blocks (cached on the sequence, extended lazily)."""
        hashes = seq.block_hashes
        num_full = seq.num_tokens // self.block_size
        parent = hashes[-1] if hashes else self._root_hash
        bs = self.block_size
        for index in range(len(hashes), num_full):
            parent = hash_block(parent_hash=parent, token_ids=seq.token_ids[index * bs : (index + 1) * bs])
            hashes.append(parent)
        return hashes[:num_full]

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (no state change).

        At least the last token is left uncached, so the model still computes one row
        whose logits sample the next token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self.block_hashes_of(seq)[:max_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_new_blocks_needed(
        self, *, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] | None = None
    ) -> int:
        """Free blocks that admitting/extending ``seq`` by ``num_new_tokens`` would consume.

        With ``cached_block_ids`` (an unadmitted sequence's prefix hits) the count includes
        reviving hits that currently sit in the free list.
        """
        if cached_block_ids is not None:
            num_computed = len(cached_block_ids) * self.block_size
            held = len(cached_block_ids)
            revived = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        else:
            num_computed = seq.num_computed_tokens
            held = len(seq.block_table)
            revived = 0
        needed = self.num_blocks_for(num_computed + num_new_tokens) - held
        return max(needed, 0) + revived

    def can_allocate(self, *, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        needed = self.num_new_blocks_needed(seq=seq, num_new_tokens=num_new_tokens, cached_block_ids=cached_block_ids)
        return needed <= len(self._free)

    # ------------------------------------------------------------------ mutations
    def take_cached_prefix(self, *, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Give a fresh sequence the cached blocks found by :meth:`lookup_prefix`."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds blocks")
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table = list(cached_block_ids)
        self.tables.set(seq, seq.block_table)
        seq.num_registered_blocks = len(cached_block_ids)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size

    def allocate_slots(self, *, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (no change) if full."""
        table = seq.block_table
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        new = [self._pop_free() for _ in range(needed)]
        table.extend(new)
        self.tables.extend(seq, new)
        return True

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past ``seq.num_computed_tokens`` (speculative decoding: slots
        reserved for proposals the target rejected), tail first; they hold no committed token."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.unpin_blocks(seq.block_table[keep:])
            del seq.block_table[keep:]
            self.tables.truncate(seq, keep)

    def commit(self, seq: Sequence, *, num_tokens: int | None = None) -> None:
        """Index the hashes of ``seq``'s newly full, computed blocks in the prefix cache (of
        its first ``num_tokens`` tokens only, when given: speculative decoding commits its
        accepted tokens one by one as they are appended)."""
        if not self.enable_prefix_caching:
            return
        num_full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes_of(seq)
        for index in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[index]
            block_hash = hashes[index]
            if block_hash not in self._hash_to_block:
                self._hash_to_block[block_hash] = block_id
                self._block_hash[block_id] = block_hash
            # else: an identical block computed concurrently stays unindexed (append-only tables)
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first) and reset its computed state."""
        self.unpin_blocks(seq.block_table)
        seq.block_table = []
        self.tables.release(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_draft_computed = 0

    def allocate_for_known_prefix(self, *, seq: Sequence, num_tokens: int) -> int | None:
        """Import hook (disaggregation): hold blocks for the first ``num_tokens`` of ``seq``.

        Reuses cached blocks where the prefix cache has them and allocates the rest. Returns
        the number of leading tokens already cached (the importer writes K/V for the tokens
        after that into ``seq.block_table``, then calls :meth:`mark_computed`), or ``None``
        if there are not enough free blocks (nothing changed). :meth:`mark_computed` indexes
        the blocks under the hashes of ``seq``'s tokens: the importer must have verified that
        the K/V it writes was computed for exactly those tokens (the handoff's prompt digest).
        """
        if num_tokens < 1 or num_tokens > seq.num_tokens:
            raise ValueError(f"num_tokens must be in [1, {seq.num_tokens}], got {num_tokens}")
        hits = self.lookup_prefix(seq)[: num_tokens // self.block_size]
        num_cached = len(hits) * self.block_size
        if not self.can_allocate(seq=seq, num_new_tokens=num_tokens - num_cached, cached_block_ids=hits):
            return None
        self.take_cached_prefix(seq=seq, cached_block_ids=hits)
        if not self.allocate_slots(seq=seq, num_new_tokens=num_tokens - num_cached):
            raise RuntimeError("allocation failed after can_allocate succeeded")
        return num_cached

    def mark_computed(self, *, seq: Sequence, num_tokens: int) -> None:
        """Import hook: the K/V of the first ``num_tokens`` of ``seq`` is now in its blocks."""
        if num_tokens > len(seq.block_table) * self.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in the {len(seq.block_table)} held blocks")
        seq.num_computed_tokens = num_tokens
        self.commit(seq)

    def pin_blocks(self, block_ids: list[int]) -> None:
        """Export hook: hold one extra reference on each block (e.g. while a decode pod pulls
        a finished prefill's KV), so freeing the sequence does not release them."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; only held blocks can be pinned")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def unpin_blocks(self, block_ids: list[int]) -> None:
        """Drop the references taken by :meth:`pin_blocks` (tail first, like :meth:`free`)."""
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was held")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight update). Held blocks stay held."""
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks

    # ------------------------------------------------------------------ internals
    def _pop_free(self) -> int:
        if not self._free:
            raise NoFreeBlocks("no free KV blocks")
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            if self._hash_to_block.get(block_hash) == block_id:
                del self._hash_to_block[block_hash]
            self._block_hash[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id
