"""Every held block table mirrored as a row of one int32 array, kept up to date as blocks
are taken and released.

A sequence's block table (``Sequence.block_table``, a list) changes rarely: one append every
``block_size`` tokens, a reset on free. A decode step, though, needs the tables of all its
sequences as one padded ``[num_decodes, max_blocks]`` tensor. Rebuilding that from the lists
costs Python work per sequence and per block every step; gathering rows of this mirror is a
single indexed copy (``array[rows, :width]``), and the slot mapping then follows from the
positions with vectorised arithmetic (:mod:`.model_runner`).

The :class:`~.block_manager.BlockManager` is the only writer: it calls :meth:`set`,
:meth:`extend`, :meth:`truncate` and :meth:`release` wherever it changes a list, so a row
equals its list's entries followed by zeros (a released row is zeroed before reuse, so
padding never points anywhere but block 0, as the list-built tables did).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .sequence import Sequence

IntArray = npt.NDArray[np.int32]


class BlockTables:
    """Rows of block ids, one per sequence that holds blocks (``seq.block_row``)."""

    def __init__(self, *, num_rows: int = 64, width: int = 16) -> None:
        self.array: IntArray = np.zeros((max(num_rows, 1), max(width, 1)), dtype=np.int32)
        self._free_rows: list[int] = list(range(self.array.shape[0] - 1, -1, -1))
        self._lengths: list[int] = [0] * self.array.shape[0]

    @property
    def num_rows_held(self) -> int:
        return int(self.array.shape[0]) - len(self._free_rows)

    def row_of(self, seq: Sequence) -> int:
        """``seq``'s row (taken on first use)."""
        row = seq.block_row
        if row < 0:
            if not self._free_rows:
                self._grow_rows()
            row = seq.block_row = self._free_rows.pop()
        return row

    def set(self, seq: Sequence, block_ids: list[int]) -> None:
        """The whole table of ``seq`` (a fresh sequence taking cached blocks)."""
        row = self.row_of(seq)
        n = len(block_ids)
        self._fit(n)
        old = self._lengths[row]
        if old > n:
            self.array[row, n:old] = 0
        if n:
            self.array[row, :n] = block_ids
        self._lengths[row] = n

    def extend(self, seq: Sequence, block_ids: list[int]) -> None:
        """Blocks appended to the table of ``seq``."""
        row = self.row_of(seq)
        start = self._lengths[row]
        end = start + len(block_ids)
        self._fit(end)
        if len(block_ids) == 1:
            self.array[row, start] = block_ids[0]
        else:
            self.array[row, start:end] = block_ids
        self._lengths[row] = end

    def truncate(self, seq: Sequence, length: int) -> None:
        """Keep the first ``length`` entries of ``seq``'s table."""
        row = seq.block_row
        if row < 0:
            return
        if self._lengths[row] > length:
            self.array[row, length : self._lengths[row]] = 0
            self._lengths[row] = length

    def release(self, seq: Sequence) -> None:
        """``seq`` holds no blocks any more: zero its row and give it back."""
        row = seq.block_row
        if row < 0:
            return
        self.array[row, : self._lengths[row]] = 0
        self._lengths[row] = 0
        self._free_rows.append(row)
        seq.block_row = -1

    def gather(self, rows: npt.NDArray[np.intp], *, width: int) -> IntArray:
        """The first ``width`` entries of each of ``rows`` (a new array)."""
        if width > self.array.shape[1]:
            raise ValueError(f"width {width} exceeds the widest table ({self.array.shape[1]})")
        return self.array[rows, :width] if width else np.zeros((len(rows), 0), dtype=np.int32)

    def _fit(self, width: int) -> None:
        if width > self.array.shape[1]:
            new_width = self.array.shape[1]
            while new_width < width:
                new_width *= 2
            grown = np.zeros((self.array.shape[0], new_width), dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown

    def _grow_rows(self) -> None:
        old = self.array.shape[0]
        grown = np.zeros((old * 2, self.array.shape[1]), dtype=np.int32)
        grown[:old] = self.array
        self.array = grown
        self._lengths.extend([0] * old)
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
