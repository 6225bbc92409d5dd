"""The run's input: records read again and prepared a chunk at a time in a thread, ahead of the engine."""
from __future__ import annotations

import queue
import threading
from typing import Iterator

from llmcli.cli.io.index import InputIndex, read_records
from llmcli.cli.io.prepare import Preparer, PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.source import InputFile

Item = tuple[int, PreparedRequest | InputRecord]  # output position, and the request or the invalid record
_END = object()


class PreparedStream:
    """Yields ``(position, request or invalid record)`` in input order.

    A thread reads ``chunk`` records at a time from the input file, parses
    them again and prepares them as one batch (chat templates, batch
    encoding on the tokenizer's own threads); at most ``ahead`` chunks wait
    in memory, so memory stays bounded however long the input is, and the
    engine never waits for tokenization of records far ahead of it.
    """

    def __init__(self, source: InputFile, index: InputIndex, preparer: Preparer, *, chunk: int = 1024,
                 ahead: int = 8) -> None:
        self.source, self.index, self.preparer, self.chunk = source, index, preparer, max(1, chunk)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="llmcli-prepare", daemon=True)
        self._thread.start()
        self._items = self._consume()

    def _produce(self) -> None:
        try:
            for start in range(0, len(self.index), self.chunk):
                if self._stop.is_set():
                    return
                recs = read_records(self.source, self.index, start, min(start + self.chunk, len(self.index)))
                self._put((start, self.preparer.prepare_batch(recs)))
            self._put(_END)
        except BaseException as exc:  # handed to the reader, which raises it
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Item]:
        return self._items

    def _consume(self) -> Iterator[Item]:
        while True:
            got = self._queue.get()
            if got is _END:
                return
            if isinstance(got, BaseException):
                raise got
            start, items = got
            yield from enumerate(items, start)

    def take(self, n: int) -> list[Item]:
        """The first ``n`` items (fewer at the end of the input); iterating afterwards continues after them."""
        taken: list[Item] = []
        while len(taken) < n:
            item = next(self._items, None)
            if item is None:
                break
            taken.append(item)
        return taken

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
