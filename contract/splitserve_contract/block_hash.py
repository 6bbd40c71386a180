"""The one KV block hash: the engine's prefix cache, the router's prefix affinity and the
planner all name a block of tokens with it.

Every *full* block of ``block_size`` tokens is identified by a chained hash
``H(parent_hash, token ids of the block)``, so equal hashes mean equal prefixes. The hash is
BLAKE2b over fixed-width little-endian bytes with a fixed root, never Python's ``hash()``: it
is identical across processes and hosts, which lets a router or a decode pod name blocks that
were computed elsewhere. Pure Python and torch-free, so the router and the operator side can
use it without the engine.

The same module holds :func:`prompt_digest`, which names a whole prompt (every token, the
partial last block included) for the prefill → decode handoff: the prefill pod signs it into
the handoff parameters (``handoff.PROMPT_DIGEST``) and the decode pod recomputes it
from the prompt it was given, so parameters computed for one prompt can never import their KV
(and index it in the prefix cache) under another prompt's block hashes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

HASH_ROOT_LABEL: Final = b"splitserve-kv-block-v1"
HASH_DIGEST_BYTES: Final = 16
PROMPT_DIGEST_LABEL: Final = b"splitserve-prompt-v1"


def root_block_hash(*, salt: bytes = b"") -> bytes:
    """The parent hash of every sequence's first block (``salt`` isolates namespaces)."""
    return hashlib.blake2b(HASH_ROOT_LABEL + salt, digest_size=HASH_DIGEST_BYTES).digest()


def hash_block(*, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: deterministic across processes and platforms."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + payload, digest_size=HASH_DIGEST_BYTES).digest()


def hash_token_blocks(
    *, token_ids: Sequence[int], block_size: int, salt: bytes = b"", max_blocks: int | None = None
) -> list[bytes]:
    """Hashes of the full leading blocks of ``token_ids`` (at most ``max_blocks``)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[bytes] = []
    parent = root_block_hash(salt=salt)
    for index in range(num_full):
        start = index * block_size
        parent = hash_block(parent_hash=parent, token_ids=token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The handoff's name of a prompt: hex SHA-256 over a fixed label and the token ids as
    fixed-width little-endian bytes (their number is implied by the length), identical on
    every pod. Not a secret: the signature is what makes it trustworthy. Raises ValueError for
    an id that is not a 64-bit integer (no tokenizer produces one)."""
    try:
        payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"prompt token ids must be 64-bit integers: {exc}") from None
    return hashlib.sha256(PROMPT_DIGEST_LABEL + b"\0" + payload).hexdigest()
