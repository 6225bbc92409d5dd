"""Reading the input: a file or stdin, as numbered raw lines."""
from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from llmcli.cli.usage_error import UsageError

# The longest input line read: far above any record llmcli can run (a prompt's bytes are bounded by
# max_model_len times the longest vocabulary entry), low enough that an IN without line breaks (a JSON
# array, a binary file) is refused after reading this much instead of filling memory.
MAX_LINE_BYTES = 64 << 20
_SPOOL_CHUNK = 1 << 20


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


def _spool_failed(folder: str, exc: OSError) -> UsageError:
    return UsageError(f"copying the input to a temporary file in {folder} failed ({exc.strerror or exc}); "
                      "set TMPDIR to a folder with room, or give IN as a file")


def _refuse_endless(stream: Any, what: str) -> None:
    """A character device other than a terminal or /dev/null (/dev/zero, /dev/urandom) never ends: refused."""
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, ValueError):
        return  # no descriptor (a test runner's stand-in): nothing to check
    if not stat.S_ISCHR(st.st_mode) or os.isatty(fd):
        return
    try:
        if os.path.samestat(st, os.stat(os.devnull)):
            return  # an empty input
    except OSError:
        pass
    raise UsageError(f"{what} is a character device, not a file or a pipe; give a JSONL file")


class InputFile:
    """The input as a seekable file, read twice: once to check every line, once to run them in chunks.

    stdin, and an IN that is a pipe (a FIFO, ``<(zcat in.jsonl.gz)``, /dev/stdin), cannot be read twice,
    so it is first copied to a temporary file (deleted on close). Neither pass holds the whole input in
    memory.
    """

    def __init__(self, path: str) -> None:
        self.name = source_name(path)
        if path == "-":
            if sys.stdin is None:
                raise OSError(errno.EBADF, "stdin is closed")
            _refuse_endless(sys.stdin.buffer, "IN is - but stdin")
            self._file = self._spool(sys.stdin.buffer)
            return
        file = open(Path(path), "rb")
        try:
            _refuse_endless(file, f"IN {path}")
        except UsageError:
            file.close()
            raise
        if file.seekable():
            self._file = file
            return
        with file:
            self._file = self._spool(file)

    @staticmethod
    def _spool(stream: BinaryIO) -> BinaryIO:
        # Read and write apart: a full TMPDIR is not a stdin that "cannot be read".
        folder = os.environ.get("TMPDIR") or "the temporary folder"
        try:
            folder = tempfile.gettempdir()
            copy = tempfile.TemporaryFile(prefix="llmcli-stdin-")
        except OSError as exc:
            raise _spool_failed(folder, exc) from None
        try:
            while chunk := stream.read(_SPOOL_CHUNK):  # a read error propagates: stdin (or the pipe) failed
                try:
                    copy.write(chunk)
                    copy.flush()
                except OSError as exc:
                    raise _spool_failed(folder, exc) from None
            copy.seek(0)
        except BaseException:
            copy.close()
            raise
        return copy

    def lines(self) -> Iterator[tuple[RawLine, int]]:
        """Every non-blank line with the byte offset where it starts, in order (each at most MAX_LINE_BYTES)."""
        self._file.seek(0)
        offset = 0
        number = 0
        while chunk := self._file.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(chunk) > MAX_LINE_BYTES:
                raise UsageError(f"{self.name}:{number}: line longer than {MAX_LINE_BYTES >> 20} MiB; IN must be "
                                 "JSONL, one JSON object per line (a JSON array or a binary file is not)")
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
