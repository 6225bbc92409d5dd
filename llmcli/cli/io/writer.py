"""Appending JSONL writer: whole lines only, flushed per record, fsynced at checkpoints, in order or not."""
from __future__ import annotations

import os
import select
import stat
import sys
import time
from typing import Any, BinaryIO

import orjson


class OutputWriteError(OSError):
    """Writing to OUT failed (disk full, I/O error); no more lines are written after it."""


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
        self.failed: OSError | None = None
        self._poll: Any = None  # OUT is a pipe: polled for its reader closing it (False: not a pipe)

    def reader_gone(self) -> bool:
        """Whether OUT is a pipe whose reader has closed it (``| head`` is done): nothing more can be read."""
        if self._poll is None:
            try:
                fd = self.stream.fileno()
                self._poll = select.poll() if stat.S_ISFIFO(os.fstat(fd).st_mode) else False
            except (AttributeError, OSError, ValueError):
                self._poll = False
            if self._poll:
                self._poll.register(fd, 0)  # only POLLERR: the read end is closed
        return bool(self._poll) and bool(self._poll.poll(0))

    def write(self, data: bytes) -> None:
        self._check()
        view = memoryview(data)
        try:
            while view:
                written = self.stream.write(view)
                # Unbuffered files may write less than asked; buffered streams return None or all.
                view = view[written:] if written else view[len(view):]
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._fail(exc)

    def sync(self) -> None:
        if self.durable and self.failed is None:
            try:
                os.fsync(self.stream.fileno())
            except OSError as exc:
                self._fail(exc)

    def _check(self) -> None:
        if self.failed is not None:
            # After a failed (maybe partial) line nothing more goes out: a torn line may only ever be the last.
            raise OutputWriteError(self.failed.errno, self.failed.strerror)

    def _fail(self, exc: OSError) -> None:
        self.failed = exc
        raise OutputWriteError(exc.errno, exc.strerror) from exc

    def close(self) -> None:
        try:
            self.sync()
        finally:
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
    stream = open(path, "ab", buffering=0)
    # fsync works on regular files only (/dev/null or a pipe reached through /dev/stdout refuse it)
    return LineSink(stream, durable=stat.S_ISREG(os.fstat(stream.fileno()).st_mode), owned=True)


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
