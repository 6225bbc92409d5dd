"""The compact form in which a scheduled step crosses from rank 0 to the other tensor-parallel ranks.

A worker never sees a whole ``Sequence``: it gets just enough to build the
same step tensors as rank 0 (``prepare_prefill`` / ``prepare_decode``), and
nothing about sampling, because only rank 0 samples.

* prefill: ``(num_computed_tokens, num_scheduled_tokens, num_tokens, block_table, chunk, pending_row, table_row,
  table_id)`` where ``chunk`` holds only the token ids computed this step;
* decode: ``(num_tokens, last_token, pending_row, block_table, table_row, table_id)``: one token, not the
  history (``table_row``/``table_id`` say which row of the worker's own block tables mirrors it). When
  the last token is still being sampled on the device (``pending_row >= 0``; rank 0 overlaps its host
  work with the device), ``last_token`` is a placeholder and every rank takes the token from row
  ``pending_row`` of the previous step's sampled tokens, which rank 0 broadcasts to the other ranks on
  the device at the end of each step.

``RemoteSequence`` rebuilds from such a tuple an object with the attributes
those two functions read; its ``token_ids`` is a window that knows only the
tokens that were sent and refuses any other slice.
"""
from __future__ import annotations

from typing import Any, Sequence as Seq



class TokenWindow:
    """The token ids at positions ``[start, start + len(tokens))`` of a sequence, indexed by absolute position."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:  # absolute length: the window ends at the last known token
        return self.start + len(self.tokens)

    def __getitem__(self, key: int | slice) -> Any:
        end = self.start + len(self.tokens)
        if isinstance(key, slice):
            lo, hi, step = key.indices(end)
            if step != 1 or lo < self.start:
                raise IndexError(f"token positions {key.start}:{key.stop} are outside what rank 0 sent "
                                 f"({self.start}:{end})")
            return self.tokens[lo - self.start:hi - self.start]
        index = key + end if key < 0 else key
        if not self.start <= index < end:
            raise IndexError(f"token position {key} is outside what rank 0 sent ({self.start}:{end})")
        return self.tokens[index - self.start]


class RemoteSequence:
    """What a tensor-parallel worker knows of one scheduled sequence for one step."""

    __slots__ = ("num_computed_tokens", "num_scheduled_tokens", "num_tokens", "block_table", "block_size",
                 "token_ids", "pending_row", "table_row", "table_id")

    def __init__(self, num_computed: int, num_scheduled: int, num_tokens: int, block_table: list[int],
                 block_size: int, tokens: list[int], pending_row: int = -1, table_row: int = -1,
                 table_id: int = 0) -> None:
        self.num_computed_tokens = num_computed
        self.num_scheduled_tokens = num_scheduled
        self.num_tokens = num_tokens
        self.block_table = block_table
        self.block_size = block_size
        self.token_ids = TokenWindow(num_computed, tokens)
        self.pending_row = pending_row
        self.table_row, self.table_id = table_row, table_id

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def samples_this_step(self) -> bool:
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens


def pack_step(seqs: Seq[Any], is_prefill: bool) -> list[tuple]:
    """Rank 0: the scheduled sequences in compact form (see the module docstring).

    Block tables are referenced, not copied: the result must be serialized before the engine moves on.
    """
    if is_prefill:
        out = []
        for s in seqs:
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            out.append((start, n, s.num_tokens, s.block_table, s.token_ids[start:start + n], s.pending_row,
                        s.table_row, s.table_id))
        return out
    return [(s.num_tokens, s.last_token, s.pending_row, s.block_table, s.table_row, s.table_id) for s in seqs]


def unpack_step(packed: list[tuple], is_prefill: bool, block_size: int) -> list[RemoteSequence]:
    """A worker: ``RemoteSequence`` objects in the order rank 0 scheduled them."""
    if is_prefill:
        return [RemoteSequence(start, n, total, table, block_size, chunk, pending, row, table_id)
                for start, n, total, table, chunk, pending, row, table_id in packed]
    return [RemoteSequence(total - 1, 1, total, table, block_size, [last], pending, row, table_id)
            for total, last, pending, table, row, table_id in packed]
