"""Reading the input: a file or stdin, as numbered raw lines."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator


@dataclass
class RawLine:
    """One non-blank input line; ``number`` is 1-based, as editors show it."""

    number: int
    data: bytes


def source_name(path: str) -> str:
    """How error messages name the input."""
    return "<stdin>" if path == "-" else path


def is_stream(path: str) -> bool:
    """IN is read once as it comes (stdin, a pipe, a device), not a file that can be read twice."""
    if path == "-":
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False  # opening it says what is wrong


def stream_open(stream: Any) -> bool:
    """Whether a standard stream (sys.stdin, sys.stdout) is usable."""
    if stream is None:  # Python saw its descriptor closed at start-up (`<&-`, `>&-`)
        return False
    try:
        os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return hasattr(stream, "buffer")  # a test runner's stand-in has no descriptor but works
    return True


def stdin_open() -> bool:
    return stream_open(sys.stdin)


def read_lines(path: str) -> list[RawLine]:
    """Every non-blank line of ``path`` ('-' is stdin), keeping physical line numbers.

    The whole input is read up front: ``--on-error fail`` must see every line
    before generation starts, and stdin cannot be read twice.
    """
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        data = Path(path).read_bytes()
    lines = []
    for number, chunk in enumerate(data.split(b"\n"), start=1):
        if chunk.strip():
            lines.append(RawLine(number, chunk.rstrip(b"\r")))
    return lines


class InputFile:
    """The input as a seekable file, read twice: once to check every line, once to run them in chunks.

    stdin, and an IN that is a pipe (a FIFO, ``<(zcat in.jsonl.gz)``, /dev/stdin), cannot be read twice,
    so it is first copied to a temporary file (deleted on close). Neither pass holds the whole input in
    memory.
    """

    def __init__(self, path: str) -> None:
        if path == "-":
            if sys.stdin is None:
                raise OSError(errno.EBADF, "stdin is closed")
            self._file = self._spool(sys.stdin.buffer)
            return
        file = open(Path(path), "rb")
        if file.seekable():
            self._file = file
            return
        with file:
            self._file = self._spool(file)

    @staticmethod
    def _spool(stream: BinaryIO) -> BinaryIO:
        copy = tempfile.TemporaryFile(prefix="llmcli-stdin-")
        shutil.copyfileobj(stream, copy, 1 << 20)
        copy.seek(0)
        return copy

    def lines(self) -> Iterator[tuple[RawLine, int]]:
        """Every non-blank line with the byte offset where it starts, in order."""
        self._file.seek(0)
        offset = 0
        for number, chunk in enumerate(iter(self._file.readline, b""), start=1):
            start = offset
            offset += len(chunk)
            data = chunk.rstrip(b"\n").rstrip(b"\r")
            if data.strip():
                yield RawLine(number, data), start

    def read_span(self, start: int, end: int) -> bytes:
        """The bytes of [start, end): a run of consecutive lines (not while ``lines()`` is being read)."""
        self._file.seek(start)
        return self._file.read(end - start)

    def close(self) -> None:
        self._file.close()
