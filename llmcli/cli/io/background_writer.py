"""The writer's own thread: outputs decoded in batches, records built, written and fsynced off the step loop."""
from __future__ import annotations

import errno
import queue
import threading
import time
from typing import Any, Callable

from llmcli.cli.io.writer import RecordWriter


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

    def check(self) -> None:
        """Raise a write error already met, or BrokenPipeError once a pipe's reader has closed OUT."""
        self._raise()
        if self.writer.sink.reader_gone():
            raise BrokenPipeError(errno.EPIPE, "the reader closed the output pipe")

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
