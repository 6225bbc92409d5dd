"""Every live sequence's block table as one row of a host array and of its device copy, kept in step by deltas.

The block manager gives a sequence a row (``table_row``) and a fresh ``table_id`` whenever it
allocates its blocks, and takes the row back when it frees them. A block table only grows while its
allocation lives, so a step only has to send the blocks appended since the row was last synced: at
batch 256 that is about one block per decode step, instead of the whole padded table.
"""
from __future__ import annotations

from typing import Any, Sequence as Seq

import numpy as np
import torch

from llmcli.engine.uploader import Uploader


class BlockTables:
    def __init__(self, max_blocks: int, device: torch.device, rows: int = 64, copy: bool | None = None) -> None:
        self.width = max_blocks
        self.device = device
        # on the CPU the "device" table is the host array itself, unless a test asks for the delta copies
        self.copy = device.type != "cpu" if copy is None else copy
        self.host = np.zeros((0, max_blocks), dtype=np.int32)
        self.owner = np.zeros(0, dtype=np.int64)  # table_id each row was synced for
        self.synced = np.zeros(0, dtype=np.int64)  # leading blocks of that row already copied
        self.table: torch.Tensor = torch.zeros(0, max_blocks, dtype=torch.int32)
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        old = self.host.shape[0]
        host = np.zeros((rows, self.width), dtype=np.int32)
        host[:old] = self.host
        self.host = host
        self.owner = np.concatenate([self.owner, np.full(rows - old, -1, dtype=np.int64)])
        self.synced = np.concatenate([self.synced, np.zeros(rows - old, dtype=np.int64)])
        if not self.copy:
            self.table = torch.from_numpy(self.host)  # the same memory: nothing to copy
        else:
            table = torch.zeros(rows, self.width, dtype=torch.int32, device=self.device)
            table[:old].copy_(self.table)
            self.table = table

    def sync(self, seqs: Seq[Any], rows: np.ndarray, uploader: Uploader, ids: np.ndarray | None = None,
             defer: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """Bring rows ``rows`` up to date with the block tables of ``seqs`` (the same order); ``ids``: their
        ``table_id``s, if the caller has them already. With ``defer``, the device copy's deltas are returned
        as (flat indices, int32 values) for the caller to send along with other inputs (``apply``), or None
        when there are none."""
        n = len(seqs)
        if ids is None:
            ids = np.fromiter((s.table_id for s in seqs), np.int64, n)
        lens = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        if n and int(lens.max()) > self.width:
            raise ValueError(f"a block table of {int(lens.max())} blocks does not fit the {self.width} columns "
                             "sized from max_model_len")
        if n and int(rows.max()) >= self.host.shape[0]:
            self._grow(max(2 * self.host.shape[0], int(rows.max()) + 1))
        stale = self.owner[rows] != ids
        if stale.any():
            self.synced[rows[stale]] = 0
            self.owner[rows[stale]] = ids[stale]
        behind = np.flatnonzero(self.synced[rows] < lens)
        if not behind.size:
            return None
        flat: list[np.ndarray] = []
        values: list[list[int]] = []
        for i in behind.tolist():
            row, seq = int(rows[i]), seqs[i]
            lo, hi = int(self.synced[row]), int(lens[i])
            new = seq.block_table[lo:hi]
            self.host[row, lo:hi] = new
            self.synced[row] = hi
            flat.append(np.arange(row * self.width + lo, row * self.width + hi))
            values.append(new)
        if self.copy:
            index = np.concatenate(flat)
            block_ids = np.concatenate([np.asarray(v, dtype=np.int32) for v in values])
            if defer:
                return index, block_ids
            self.upload(index, block_ids, uploader)
        return None

    def upload(self, index: np.ndarray, block_ids: np.ndarray, uploader: Uploader) -> None:
        """Send deltas (``sync(defer=True)``'s) to the device copy."""
        index_t, = uploader.upload(torch.int64, index)
        values_t, = uploader.upload(torch.int32, block_ids)
        self.apply(index_t, values_t)

    def apply(self, index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Write deltas already on the device into the device copy."""
        self.table.view(-1).index_copy_(0, index, block_ids)

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """Flat cache slot of each token at ``positions`` of the sequence in row ``rows`` (one row per token)."""
        return self.host[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def gather(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """[len(rows), width] block tables on the device (all columns unless ``width``)."""
        table = self.table if width is None else self.table[:, :width]
        return table.index_select(0, rows)


def table_rows(seqs: Seq[Any]) -> np.ndarray:
    return np.fromiter((s.table_row for s in seqs), np.int64, len(seqs))


def scratch_tables(seqs: Seq[Any], device: torch.device, uploader: Uploader) -> tuple[BlockTables, np.ndarray]:
    """Tables for sequences that no block manager gave rows (tests, a worker's first look): row i for seq i."""
    width = max([len(s.block_table) for s in seqs] + [1])
    tables = BlockTables(width, device, rows=max(len(seqs), 1))
    rows = np.arange(len(seqs), dtype=np.int64)
    tables.sync([_Fresh(s) for s in seqs], rows, uploader)
    return tables, rows


class _Fresh:
    """A sequence seen as one fresh allocation (for ``scratch_tables``)."""

    __slots__ = ("block_table", "table_id")

    def __init__(self, seq: Any) -> None:
        self.block_table, self.table_id = seq.block_table, 0
