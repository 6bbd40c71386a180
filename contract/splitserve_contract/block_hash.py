"""The one KV block hash: the engine's prefix cache, the router's prefix affinity and the
planner all name a block of tokens with it.

Every *full* block of ``block_size`` tokens is identified by a chained hash
``H(parent_hash, token ids of the block)``, so equal hashes mean equal prefixes. The hash is
BLAKE2b over fixed-width little-endian bytes with a fixed root, never Python's ``hash()``: it
is identical across processes and hosts, which lets a router or a decode pod name blocks that
were computed elsewhere. Pure Python and torch-free, so the router and the operator side can
use it without the engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

HASH_ROOT_LABEL: Final = b"splitserve-kv-block-v1"
HASH_DIGEST_BYTES: Final = 16


def root_block_hash(*, salt: bytes = b"") -> bytes:
    """The parent hash of every sequence's first block (``salt`` isolates namespaces)."""
    return hashlib.blake2b(HASH_ROOT_LABEL + salt, digest_size=HASH_DIGEST_BYTES).digest()


def hash_block(*, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: deterministic across processes and platforms."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + payload, digest_size=HASH_DIGEST_BYTES).digest()


def hash_token_blocks(*, token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                      max_blocks: int | None = None) -> list[bytes]:
    """Hashes of the full leading blocks of ``token_ids`` (at most ``max_blocks``)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[bytes] = []
    parent = root_block_hash(salt=salt)
    for index in range(num_full):
        start = index * block_size
        parent = hash_block(parent_hash=parent, token_ids=token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
