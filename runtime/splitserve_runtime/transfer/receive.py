"""Receiving one pull's BLOCK frames straight into where the blocks go.

Why its own loop rather than "read a header, then read a block" per frame: for 128 KiB blocks
the Python work around each frame (two reads, a header object, a timer) added about a third to
the receiving side's CPU time, and the receiver is the side that bounds a transfer. Here the frames' layout is known in advance (every BLOCK frame is a 20-byte
head, then exactly one block), so one scatter list covers the next few frames at once, heads
and destinations alike, and each ``recvmsg_into`` fills as much of it as the socket holds.
Each head is checked the moment its bytes are in (a byte comparison with the head expected:
magic, version, type, length, index), so a peer that sends anything else is refused at once,
not after waiting for bytes it will never send; the CRC reads each chunk of bytes right after
the system call that brought it (still in the CPU's cache, not once more from memory); each
block is handed over once whole and CRC-checked, in order (a block is whole before the next
head can have arrived).

Bytes of the next frames may land in their destination before their head is checked: a
failed pull leaves garbage there, which the contract of ``fetch`` already covers (the
blocks of a failed fetch are discarded). A plain sink never sees unchecked bytes: it gets
one of a few staging buffers, and only after the CRC passed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .connector import BlockDestination, BlockSink, TransferError
from .framing import (
    BLOCK_HEADER_SIZE,
    BLOCK_INDEX,
    HEADER_SIZE,
    FrameType,
    check_crc,
    crc32,
    decode_header,
    encode_header,
)
from .wire import MAX_IOVECS, Channel, PeerClosed, byte_view, consume

RECEIVE_AHEAD_BYTES = 1024 * 1024
"""How many bytes of frames one scatter list covers (at least two frames): fewer system
calls and Python steps per block; a plain sink costs this much staging memory."""
_CRC_OFFSET = HEADER_SIZE - 4  # the header's last field


class BlockReceiver:
    """Receives blocks ``first_block..num_blocks - 1`` of one pull from ``channel``."""

    def __init__(
        self,
        *,
        channel: Channel,
        block_nbytes: int,
        on_block: BlockSink | BlockDestination,
        timeout_seconds: float,
        first_block: int,
        num_blocks: int,
    ) -> None:
        """``block_nbytes``: the bytes of each block on the wire (a whole block, or the
        :class:`~.slices.KVSlice` of it that was asked for)."""
        self._channel = channel
        self._block_nbytes = block_nbytes
        self._frame_nbytes = BLOCK_HEADER_SIZE + block_nbytes
        self._timeout_seconds = timeout_seconds
        self._first_block = first_block
        self._num_blocks = num_blocks
        self._destination: BlockDestination | None = None
        self._sink: BlockSink | None = None
        if isinstance(on_block, BlockDestination):
            self._destination = on_block
        else:
            self._sink = on_block
        self._ahead = min(
            max(2, min(RECEIVE_AHEAD_BYTES // self._block_nbytes, (MAX_IOVECS - 1) // 2)),
            max(1, num_blocks - first_block),
        )
        self._heads = [memoryview(bytearray(BLOCK_HEADER_SIZE)) for _ in range(self._ahead)]
        self._staging: list[memoryview] = []
        self._buffers: list[Sequence[memoryview]] = [()] * self._ahead
        self._crcs = [0] * self._ahead
        self._expected_head = encode_header(
            frame_type=FrameType.BLOCK,
            payload_len=BLOCK_INDEX.size + self._block_nbytes,
            crc=0,
        )[:_CRC_OFFSET]

    def _post(self, index: int) -> list[memoryview]:
        """The scatter segments of block ``index``'s frame (its slot's head, then its buffers)."""
        slot = (index - self._first_block) % self._ahead
        if self._destination is not None:
            buffers = [byte_view(buffer) for buffer in self._destination.buffers(index)]
            if sum(map(len, buffers)) != self._block_nbytes or any(b.readonly for b in buffers):
                raise ValueError(f"the destination of block {index} is not {self._block_nbytes} writable bytes")
        else:
            while len(self._staging) <= slot:
                self._staging.append(memoryview(bytearray(self._block_nbytes)))
            buffers = [self._staging[slot]]
        self._buffers[slot] = buffers
        return [self._heads[slot], *buffers]

    def _check_head(self, index: int, *, complete: bool) -> None:
        """Refuse block ``index``'s head unless it is the one due (FrameError or TransferError):
        on its first 16 bytes (the header) or, ``complete``, all 20 (with the index)."""
        head = self._heads[(index - self._first_block) % self._ahead]
        if head[:_CRC_OFFSET] != self._expected_head:
            header = decode_header(head[:HEADER_SIZE], max_payload_bytes=self._block_nbytes + 64)
            if header.type is not FrameType.BLOCK:
                raise TransferError(code="protocol", message=f"expected BLOCK {index}, got {header.type.name}")
            if header.payload_len == BLOCK_INDEX.size + self._block_nbytes:
                raise TransferError(code="corrupt", message=f"BLOCK {index}'s header has reserved bits set")
            raise TransferError(
                code="corrupt",
                message=(
                    f"a BLOCK frame of {header.payload_len} bytes where block {index} "
                    f"with {self._block_nbytes} bytes was due"
                ),
            )
        if complete:
            (sent_index,) = BLOCK_INDEX.unpack_from(head, HEADER_SIZE)
            if sent_index != index:
                raise TransferError(code="corrupt", message=f"block {sent_index} where block {index} was due")

    def _checksum(self, number: int, start: int, end: int) -> None:
        """Fold bytes ``start..end`` of frame ``number`` (offsets in the frame, past its 16-byte
        header: the index, then the block) into the frame's CRC, right after they arrived."""
        slot = number % self._ahead
        crc = 0 if start == HEADER_SIZE else self._crcs[slot]
        if start < BLOCK_HEADER_SIZE:
            top = min(end, BLOCK_HEADER_SIZE)
            crc = crc32(self._heads[slot][start:top], crc)
            start = top
        offset = BLOCK_HEADER_SIZE
        for buffer in self._buffers[slot]:
            if offset >= end:
                break
            following = offset + len(buffer)
            if start < following:
                crc = crc32(buffer[max(start, offset) - offset : min(end, following) - offset], crc)
            offset = following
        self._crcs[slot] = crc

    def _deliver(self, index: int) -> None:
        slot = (index - self._first_block) % self._ahead
        head = self._heads[slot]
        buffers = self._buffers[slot]
        crc = self._crcs[slot]
        (expected,) = BLOCK_INDEX.unpack_from(head, _CRC_OFFSET)  # the header's CRC field (u32)
        if crc != expected:
            header = decode_header(head[:HEADER_SIZE], max_payload_bytes=self._block_nbytes + 64)
            check_crc(header, crc)  # raises FrameError naming the frame
        if self._destination is not None:
            self._destination.received(index)
        else:
            assert self._sink is not None
            self._sink(index, buffers[0])

    async def receive(self) -> int:
        """Receive every block; returns the BLOCK payload bytes taken. Raises TransferError,
        FrameError, PeerClosed, TimeoutError or OSError."""
        count = self._num_blocks - self._first_block
        frame = self._frame_nbytes
        total = count * frame
        segments: list[memoryview] = []
        first_segment = 0
        received = 0  # bytes of the BLOCK frames so far
        checksummed = 0  # how far the CRCs have read
        posted = delivered = 0  # frames, relative to first_block
        head_checked = False  # that of frame `delivered`, the one partly received
        timed = -1  # the frame the channel's deadline was set for
        channel = self._channel
        while delivered < count:
            while posted < count and posted - delivered < self._ahead:
                segments += self._post(self._first_block + posted)
                posted += 1
            if timed != delivered:  # each frame within the timeout of the one before
                channel.expire_in(self._timeout_seconds)
                timed = delivered
            got = await channel.recv_some(segments[first_segment:])
            if not got:
                raise PeerClosed(received=received, expected=total)
            received += got
            first_segment = consume(segments, first_segment, got)
            if first_segment >= 1024:
                del segments[:first_segment]
                first_segment = 0
            while checksummed < received:  # while the new bytes are still in the CPU's cache
                number, offset = divmod(checksummed, frame)
                if offset < HEADER_SIZE:
                    checksummed = number * frame + HEADER_SIZE
                    continue
                end = min(received, (number + 1) * frame)
                self._checksum(number, offset, end - number * frame)
                checksummed = end
            while delivered < posted:  # in stream order: all frames before it are whole
                start = delivered * frame
                if received < start + HEADER_SIZE:
                    break
                if not head_checked:
                    complete = received >= start + BLOCK_HEADER_SIZE
                    self._check_head(self._first_block + delivered, complete=complete)
                    if not complete:
                        break
                    head_checked = True
                if received < start + frame:
                    break
                self._deliver(self._first_block + delivered)
                delivered += 1
                head_checked = False
        return count * (BLOCK_INDEX.size + self._block_nbytes)
