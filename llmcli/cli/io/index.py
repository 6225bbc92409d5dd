"""The checking pass: every input line parsed and checked, and only where each line to run lies kept."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

from llmcli.cli.io.records import InputRecord, describe_duplicate, parse_line
from llmcli.cli.io.source import InputFile, RawLine


@dataclass
class InputIndex:
    """The records to run, by output position: line number and byte span of each, and the invalid ones.

    A few bytes per record, so a file of millions of records costs megabytes
    here; their text and token ids are read again, a chunk at a time, when
    the run reaches them (``cli/io/stream.py``).
    """

    total: int = 0  # records in the input
    lines: array = field(default_factory=lambda: array("q"))
    offsets: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("q"))
    bad: dict[int, InputRecord] = field(default_factory=dict)  # position -> the record and its error
    duplicates: list[InputRecord] = field(default_factory=list)  # records repeating an earlier id (any line)

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def errors(self) -> list[InputRecord]:
        return [self.bad[p] for p in sorted(self.bad)]


def index_input(source: InputFile, answered: set[str], check: Callable[[InputRecord], None],
                seen: Callable[[InputRecord], None] | None = None) -> InputIndex:
    """Parse every line and hand it to ``seen`` (the input fingerprint); ``check`` those OUT does not answer
    yet and keep where they lie (an invalid line stays answered by its error record). Duplicate ids are
    listed apart: the output could not tell them apart, so no run may start (whether answered or not)."""
    index = InputIndex()
    first_line: dict[str, int] = {}
    parse = _parser(source)
    for raw, offset in source.lines():
        rec = parse(raw)
        index.total += 1
        if seen is not None:
            seen(rec)
        first = first_line.setdefault(rec.key, rec.line)
        if first != rec.line:
            describe_duplicate(rec, first)
            index.duplicates.append(rec)
        if rec.key in answered:
            continue
        check(rec)
        position = len(index.lines)
        index.lines.append(raw.number)
        index.offsets.append(offset)
        index.lengths.append(len(raw.data))
        if rec.error is not None:
            rec.prompt = None  # an error record needs only the record's name and the error
            index.bad[position] = rec
    return index


def read_records(source: InputFile, index: InputIndex, start: int, stop: int) -> list[InputRecord]:
    """Positions [start, stop) parsed again from the file (the invalid ones as the checking pass left them)."""
    if start >= stop:
        return []
    base = index.offsets[start]
    span = source.read_span(base, index.offsets[stop - 1] + index.lengths[stop - 1])
    recs = []
    parse = _parser(source)
    for p in range(start, stop):
        bad = index.bad.get(p)
        if bad is not None:
            recs.append(bad)
            continue
        at = index.offsets[p] - base
        recs.append(parse(RawLine(index.lines[p], span[at:at + index.lengths[p]])))
    return recs


def _parser(source: InputFile) -> Callable[[RawLine], InputRecord]:
    """How ``source``'s lines become records: a table input's rows have their own (``cli/io/tables.py``)."""
    return getattr(source, "parse", parse_line)
