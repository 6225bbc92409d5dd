"""Reading the input: a file or stdin, as numbered raw lines."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RawLine:
    """One non-blank input line; ``number`` is 1-based, as editors show it."""

    number: int
    data: bytes


def source_name(path: str) -> str:
    """How error messages name the input."""
    return "<stdin>" if path == "-" else path


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
