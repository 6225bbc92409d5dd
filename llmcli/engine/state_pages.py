"""Where a hybrid model's per-sequence states live: rows of pages in the one buffer the KV blocks come from.

Row ``r`` of the state pool (``Sequence.table_row``) takes pages ``[r * row_pages, (r + 1) * row_pages)`` of
the buffer (engine/state_pool.py lays each linear-attention layer's conv and recurrent state over them as a
strided view). After the ``seq_rows`` rows sequences hold come the prefix cache's snapshot rows and a scratch
row (``fixed_rows``), taken for good; KV-only pages follow.

Shared (the pool sized from the memory left, the default): a row's pages hold KV blocks while no sequence
holds the row. A sequence starts in the lowest free row none of whose pages holds a KV block in use, and the
block manager hands out KV blocks from the highest free page down, so states and KV meet in the middle and
the split between them follows the workload: many short sequences or a few long ones fill the same memory.
Static (``num_kvcache_blocks`` set: that many KV blocks exactly): the rows' pages are theirs alone.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StatePages:
    """The runner's plan of the state rows (plain data for the scheduler and the memory report)."""

    row_pages: int  # pages (KV blocks) one row's states take
    seq_rows: int  # rows sequences may hold (max_num_seqs + 1: a finished sequence's row may be in flight)
    fixed_rows: int  # the snapshot rows and the scratch row after them
    shared: bool

    @property
    def rows(self) -> int:
        return self.seq_rows + self.fixed_rows

    @property
    def reserved(self) -> int:
        """Pages never handed out as KV blocks."""
        return (self.fixed_rows if self.shared else self.rows) * self.row_pages

    def kv_room(self, num_pages: int) -> int:
        """The most KV blocks one sequence may hold in a pool of ``num_pages`` (beside its own states)."""
        return num_pages - self.reserved - (self.row_pages if self.shared else 0)


class StateRows:
    """Which rows are free, and (shared) how many KV blocks in use lie in each row's pages."""

    def __init__(self, pages: StatePages) -> None:
        self.pages = pages
        self.free = list(range(pages.seq_rows))  # sorted: the lowest claimable row is taken
        self.busy = [0] * pages.seq_rows
        self._limit = pages.seq_rows * pages.row_pages if pages.shared else 0  # pages below it belong to rows

    def claimable(self, count: int = 1) -> list[int]:
        """The lowest ``count`` free rows none of whose pages holds a KV block in use."""
        out = []
        for row in self.free:
            if not self.busy[row]:
                out.append(row)
                if len(out) == count:
                    break
        return out

    def claim(self, row: int) -> range:
        """Take ``row``; the pages that leave the KV pool (none when static)."""
        self.free.pop(bisect.bisect_left(self.free, row))
        return self.page_range(row) if self.pages.shared else range(0)

    def release(self, row: int) -> range:
        """Give ``row`` back; the pages that return to the KV pool (none when static)."""
        bisect.insort(self.free, row)
        return self.page_range(row) if self.pages.shared else range(0)

    def page_range(self, row: int) -> range:
        n = self.pages.row_pages
        return range(row * n, (row + 1) * n)

    def kv_taken(self, page: int) -> None:
        if page < self._limit:
            self.busy[page // self.pages.row_pages] += 1

    def kv_freed(self, page: int) -> None:
        if page < self._limit:
            self.busy[page // self.pages.row_pages] -= 1


class FreshPages:
    """Free pages holding no cached block, handed out highest first (the state rows lie at the bottom)."""

    def __init__(self, size: int, pages: Iterable[int]) -> None:
        self._free = bytearray(size)
        self._queued = bytearray(size)  # has an entry in the heap (a stale one once taken out of the set)
        self._heap = []
        for page in pages:
            self._free[page] = self._queued[page] = 1
            self._heap.append(-page)
        heapq.heapify(self._heap)
        self._count = len(self._heap)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: int) -> bool:
        return bool(self._free[page])

    def add(self, page: int) -> None:
        self._free[page] = 1
        self._count += 1
        if not self._queued[page]:
            self._queued[page] = 1
            heapq.heappush(self._heap, -page)

    def remove(self, page: int) -> None:
        self._free[page] = 0
        self._count -= 1

    def pop(self) -> int:
        while True:
            page = -heapq.heappop(self._heap)
            self._queued[page] = 0
            if self._free[page]:
                self.remove(page)
                return page


def state_pages_of(report: object) -> StatePages | None:
    """A runner's ``MemoryReport``'s state rows (None: not a hybrid model, or a stand-in runner)."""
    return getattr(report, "state_pages", None)


def kv_room_of(report: object, num_blocks: int) -> int:
    """The most KV blocks one sequence may hold in a runner's pool of ``num_blocks`` (pages, for a hybrid)."""
    pages = state_pages_of(report)
    return num_blocks if pages is None else pages.kv_room(num_blocks)
