"""Appending JSONL writer: whole lines only, flushed per record, fsynced at checkpoints, in order or not."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, BinaryIO

import orjson


class LineSink:
    """Where output lines go: a file opened for append, or stdout.

    Each line is handed to the OS in one piece and flushed at once, so a
    process killed at any moment leaves at most a torn *last* line (which
    ``--resume`` cuts off), never a torn line in the middle.
    """

    def __init__(self, stream: BinaryIO, durable: bool, owned: bool) -> None:
        self.stream = stream
        self.durable = durable  # fsync at checkpoints (a regular file; pipes cannot be synced)
        self.owned = owned

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self.stream.write(view)
            # Unbuffered files may write less than asked; buffered streams return None or all.
            view = view[written:] if written else view[len(view):]
        self.stream.flush()

    def sync(self) -> None:
        if self.durable:
            os.fsync(self.stream.fileno())

    def close(self) -> None:
        self.sync()
        if self.owned:
            self.stream.close()


def reserve_stdout() -> BinaryIO:
    """Keep stdout for JSONL alone: records get a private copy of it, and fd 1 is pointed at stderr.

    Libraries (or the engine) that print would otherwise interleave text with
    the records of ``-o -``. Where stdout has no file descriptor (a test
    runner's capture) its buffer is used as is.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.stdout.buffer
    sys.stdout.flush()
    private = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    return os.fdopen(private, "wb", buffering=0)


def open_sink(path: str, stdout: BinaryIO | None = None) -> LineSink:
    """Open OUT for appending ('-' is stdout, or the ``stdout`` stream given)."""
    if path == "-":
        return LineSink(stdout if stdout is not None else sys.stdout.buffer, durable=False, owned=False)
    return LineSink(open(path, "ab", buffering=0), durable=True, owned=True)


class RecordWriter:
    """Writes output records as they become final.

    Ordered mode holds a finished record until every earlier position is
    written; unordered mode writes it at once. Every input position must be
    ``put`` exactly once (answers and error records alike).
    """

    def __init__(self, sink: LineSink, ordered: bool = True, checkpoint_every: int = 256,
                 checkpoint_seconds: float = 5.0) -> None:
        self.sink = sink
        self.ordered = ordered
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.next_position = 0
        self.pending: dict[int, dict[str, Any]] = {}
        self.written = 0
        self._since_sync = 0
        self._last_sync = time.monotonic()

    def put(self, position: int, record: dict[str, Any]) -> None:
        if not self.ordered:
            self._emit(record)
            return
        self.pending[position] = record
        while self.next_position in self.pending:
            self._emit(self.pending.pop(self.next_position))
            self.next_position += 1

    def drain(self) -> None:
        """Write every held record now, in position order, even across gaps (on interrupt)."""
        for position in sorted(self.pending):
            self._emit(self.pending.pop(position))

    def close(self) -> None:
        self.sink.close()

    def _emit(self, record: dict[str, Any]) -> None:
        self.sink.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        self.written += 1
        self._since_sync += 1
        now = time.monotonic()
        if self._since_sync >= self.checkpoint_every or now - self._last_sync >= self.checkpoint_seconds:
            self.sink.sync()
            self._since_sync, self._last_sync = 0, now
