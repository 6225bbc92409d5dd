"""Appending JSONL writer: whole lines only, flushed per record, fsynced at checkpoints, in order or not."""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Any, BinaryIO, Callable

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


class BackgroundWriter:
    """A RecordWriter fed through a queue: building, encoding, writing and fsync run in their own thread.

    The step loop only hands over ``(position, make_record, outputs)``; the
    thread fills in the outputs' text in batches (``finish``: the engine's
    batch detokenization), builds each record and gives it to the inner
    writer, which keeps the order and the whole-lines promise. A write error
    (a closed pipe, a full disk) is raised by the next ``put`` or by ``close``.
    """

    def __init__(self, writer: RecordWriter, finish: Callable[[list], None] | None = None) -> None:
        self.writer = writer
        self.finish = finish
        self.batch_seconds = 0.02
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="llmcli-writer", daemon=True)
        self._thread.start()

    @property
    def written(self) -> int:
        return self.writer.written

    def put(self, position: int, make_record: Callable[[], dict[str, Any]], outputs: list = ()) -> None:
        self._raise()
        self._queue.put(("put", position, make_record, outputs))

    def drain(self) -> None:
        """Write everything handed over so far, then every held record (see RecordWriter.drain)."""
        self._call("drain")

    def close(self) -> None:
        self._call("close")
        self._thread.join()

    def _call(self, op: str) -> None:
        done = threading.Event()
        self._queue.put((op, done))
        while not done.wait(0.1) and self._thread.is_alive():
            pass
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]
            if batch[0][0] == "put":
                # Wake up at most every few tens of milliseconds: each wake-up takes the GIL from the step loop.
                time.sleep(self.batch_seconds)
            while len(batch) < 4096:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if self.finish is not None:
                    outputs = [o for item in batch if item[0] == "put" for o in item[3]]
                    if outputs:
                        self.finish(outputs)
            except BaseException as exc:
                self._error = exc
            for item in batch:
                if item[0] == "put":
                    if self._error is None:
                        try:
                            self.writer.put(item[1], item[2]())
                        except BaseException as exc:
                            self._error = exc
                    continue
                op, done = item
                try:
                    if self._error is None:
                        self.writer.drain() if op == "drain" else self.writer.close()
                    elif op == "close":
                        self.writer.close()
                except BaseException as exc:
                    self._error = self._error or exc
                finally:
                    done.set()
                if op == "close":
                    return
