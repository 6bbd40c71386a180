"""The connector interface between the engine and a KV transport.

The decode side asks a connector to fetch the blocks of one request from the prefill pod that
computed them; the connector hands each verified block to a sink (which writes it into the local
paged cache) and reports what it moved. Nothing here depends on torch or on the transport, so a
GPU transport can implement the same `fetch` and be selected by configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .slices import KVSlice


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block as it travels: all layers' K then V for `block_size` tokens.

    Both sides must agree exactly; `compat_hash` (image + model + KV layout, see
    contract.LABEL_COMPAT_HASH) catches mismatches the shape alone would not (another model
    with the same shape). Blocks travel as the cache's raw bytes: `dtype` names the cache
    dtype (e.g. "bfloat16", or "float8_e4m3fn" for an fp8 cache, 1 byte per element), so a
    bf16 decode pod never accepts fp8 blocks or the reverse.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    compat_hash: str = ""

    @property
    def block_nbytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def mismatch(self, other: KVLayout) -> str:
        """What differs from ``other`` ("" if nothing), e.g. ``dtype float8_e4m3fn != bfloat16``."""
        return ", ".join(
            f"{f.name} {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        )

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KVLayout:
        try:
            return cls(**body)
        except TypeError as exc:
            raise TransferError(code="protocol", message=f"bad KV layout {body!r}: {exc}") from exc


class TransferError(Exception):
    """A fetch that did not deliver every block intact. `code` is stable for metrics/logs:
    connect_failed, timeout, corrupt, truncated, unknown_request, layout_mismatch, protocol,
    prompt_mismatch, unauthorized (the server refused us), unauthenticated (the server did
    not prove it holds the handoff key), endpoint_not_allowed (see :mod:`.auth`)."""

    def __init__(self, *, code: str, message: str) -> None:
        super().__init__(f"KV transfer failed ({code}): {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FetchResult:
    num_blocks: int
    num_bytes: int
    num_tokens: int
    seconds: float


BlockSink = Callable[[int, memoryview], None]
"""Called once per received, verified block with (block index within the request, block
bytes). The bytes are valid only during the call (the connector receives the next block into
the same buffer): copy them into the cache, keep no reference."""


@runtime_checkable
class BlockDestination(Protocol):
    """A sink that lets the connector receive each block straight into its final place (no
    copy after the socket's): give it to ``fetch`` instead of a :data:`BlockSink`."""

    def buffers(self, index: int) -> Sequence[memoryview]:
        """Writable byte views whose lengths add up to one block: where block ``index``'s bytes
        land, in order. Called in block order, a few blocks ahead of their arrival: the
        buffers of different blocks must not overlap. If the fetch fails, whatever they hold
        is garbage (the caller discards the blocks of a failed fetch)."""
        ...

    def received(self, index: int) -> None:
        """Block ``index`` arrived whole in :meth:`buffers` and passed its CRC."""
        ...


class KVConnector(Protocol):
    async def fetch(
        self,
        *,
        endpoint: str,
        request_id: str,
        first_block: int,
        layout: KVLayout,
        on_block: BlockSink | BlockDestination,
        timeout_seconds: float,
        expected_num_tokens: int | None = None,
        slice: KVSlice | None = None,
        release: bool = True,
    ) -> FetchResult:
        """Fetch blocks `first_block..` of `request_id` from `endpoint` ("host:port"); with
        `expected_num_tokens`, a server holding another number of tokens is refused before
        any block. With `slice`, only those layers and KV heads of each block travel (a
        parallel rank's part, :mod:`.slices`; default: whole blocks). `release=False` leaves
        the blocks pinned on the server (other ranks still pull other slices of them). Raises
        TransferError (only); blocks already handed to `on_block` (or written into a
        destination's buffers) must then be discarded."""
        ...
