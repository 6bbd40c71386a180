"""Types of the prefill → decode KV handoff hooks of :class:`~.llm_engine.LLMEngine`.

Prefill side: a request added with ``keep_kv=True`` keeps its computed blocks pinned when it
finishes (:class:`KeptKV`), so a decode pod can pull them; ``release_kept_kv`` unpins them
(after the pull, or when the lease runs out). Decode side: ``reserve_imported_request``
allocates blocks for a prefix computed elsewhere (reusing local prefix-cache hits) and
returns which blocks to fill (:class:`ImportReservation`); after the bytes are written with
``ModelRunner.write_block``, ``activate_imported_request`` starts decoding, or
``cancel_imported_request`` frees the blocks if the transfer failed.

Block bytes use :meth:`~.model_runner.ModelRunner.read_block`'s layout on both sides.

Activation indexes the imported blocks in the prefix cache under the block hashes of the
token ids the reservation was made for, so those token ids must be the ones the KV was
computed for: the decode side reserves only a prompt whose digest matched the signed handoff
parameters' (:class:`~.remote.HandoffEngine`), never a prompt it was merely told about.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KeptKV:
    """Pinned blocks of a finished prefill: ``block_ids[i]`` holds tokens
    ``[i * block_size, (i + 1) * block_size)`` of ``token_ids`` (the last one may be partial)."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[bytes]
    """Chained hashes of the full blocks (identical on every pod; see block_manager)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, kw_only=True)
class ImportReservation:
    """Blocks reserved for an imported prefix; write blocks ``first_block_index ..`` of the
    sender's :class:`KeptKV` into ``block_ids[first_block_index:]``."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    """Leading tokens already in the local prefix cache (whole blocks; no transfer needed)."""
    block_size: int
    imported_text: str = ""
    """Output text of the imported tokens after the prompt (the first token's, as this
    engine's detokenizer renders it); the engine streams only the text after it."""

    @property
    def first_block_index(self) -> int:
        return self.num_cached_tokens // self.block_size
