"""Every live sequence's block table as one row of a host array and of its device copy, kept in step by deltas.

The step plan carries, for each row, the blocks appended since the last plan (a whole table when the row
changed hands, about one block per decode step at batch 256 otherwise); ``write`` puts them in the host
array and returns the device copy's deltas, instead of the whole padded table.
"""
from __future__ import annotations

import numpy as np
import torch

from llmcli.engine.uploader import Uploader

Deltas = tuple[np.ndarray, np.ndarray]  # flat indices into the table (int64) and block ids (int32)


class BlockTables:
    def __init__(self, max_blocks: int, block_size: int, device: torch.device, rows: int = 64,
                 copy: bool | None = None) -> None:
        self.width = max_blocks
        self.block_size = block_size
        self.device = device
        # on the CPU the "device" table is the host array itself, unless a test asks for the delta copies
        self.copy = device.type != "cpu" if copy is None else copy
        self.host = np.zeros((0, max_blocks), dtype=np.int32)
        self.table: torch.Tensor = torch.zeros(0, max_blocks, dtype=torch.int32)
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        old = self.host.shape[0]
        host = np.zeros((rows, self.width), dtype=np.int32)
        host[:old] = self.host
        self.host = host
        if not self.copy:
            self.table = torch.from_numpy(self.host)  # the same memory: nothing to copy
        else:
            table = torch.zeros(rows, self.width, dtype=torch.int32, device=self.device)
            table[:old].copy_(self.table)
            self.table = table

    def write(self, blocks: list[tuple[int, int, list[int]]], uploader: Uploader, defer: bool = False,
              ) -> Deltas | None:
        """Write a plan's ``blocks`` ((row, first index, block ids) each) into the host array, and send them to
        the device copy; with ``defer`` the deltas are returned instead, for the caller to send along with
        other inputs (``apply``). None when nothing is left to send."""
        if not blocks:
            return None
        top = max(row for row, _, _ in blocks)
        if top >= self.host.shape[0]:
            self._grow(max(2 * self.host.shape[0], top + 1))
        flat: list[np.ndarray] = []
        for row, lo, new in blocks:
            hi = lo + len(new)
            if hi > self.width:
                raise ValueError(f"a block table of {hi} blocks does not fit the {self.width} columns "
                                 "sized from max_model_len")
            self.host[row, lo:hi] = new
            flat.append(np.arange(row * self.width + lo, row * self.width + hi))
        if not self.copy:
            return None
        index = np.concatenate(flat)
        block_ids = np.concatenate([np.asarray(new, dtype=np.int32) for _, _, new in blocks])
        if defer:
            return index, block_ids
        self.upload(index, block_ids, uploader)
        return None

    def upload(self, index: np.ndarray, block_ids: np.ndarray, uploader: Uploader) -> None:
        """Send deltas (``write(defer=True)``'s) to the device copy."""
        index_t, = uploader.upload(torch.int64, index)
        values_t, = uploader.upload(torch.int32, block_ids)
        self.apply(index_t, values_t)

    def apply(self, index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Write deltas already on the device into the device copy."""
        self.table.view(-1).index_copy_(0, index, block_ids)

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat cache slot of each token at ``positions`` of the sequence in row ``rows`` (one row per token)."""
        bs = self.block_size
        return self.host[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def gather(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """[len(rows), width] block tables on the device (all columns unless ``width``)."""
        table = self.table if width is None else self.table[:, :width]
        return table.index_select(0, rows)
