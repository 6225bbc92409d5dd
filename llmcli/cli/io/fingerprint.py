"""Which input produced OUT: a small fingerprint in a sidecar file (``OUT.llmcli-input``) that --resume checks.

The fingerprint is the number of input records and a hash of their content
(id or line position, prompt, per-record fields) in order, not of the file's
bytes: reformatting a line changes nothing, nor do blank lines between records
that carry an id. A record without one is named by its line position, so a
blank line inserted before it renames it and the resume is refused. A resume
accepts an input whose first records are exactly the ones that produced OUT,
so appending new lines to IN and resuming runs just the new ones; anything
else is refused unless ``--force-resume``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import orjson
import xxhash

from llmcli.cli.io.records import InputRecord

SUFFIX = ".llmcli-input"


class InputMismatch(Exception):
    """IN is not the input that produced OUT."""


@dataclass(frozen=True)
class Fingerprint:
    records: int
    digest: str  # xxh3-128 of the records' content, in order


def sidecar_path(output: str | Path) -> Path:
    out = Path(os.path.realpath(output))  # next to the file itself, whichever link names it
    return out.with_name(out.name + SUFFIX)


def _content(rec: InputRecord) -> bytes:
    return orjson.dumps([rec.key, rec.kind, rec.prompt, rec.sampling, rec.openai.url if rec.openai else None,
                         rec.error.field if rec.error and rec.prompt is None else None],
                        option=orjson.OPT_SORT_KEYS)


class FingerprintBuilder:
    """The fingerprint of records seen one at a time (the checking pass holds none of them), and that of
    the first ``prefix`` of them (what a resumed OUT's sidecar is compared with)."""

    def __init__(self, prefix: int | None = None) -> None:
        self._hash, self.records = xxhash.xxh3_128(), 0
        self._prefix_at = prefix
        self.prefix: Fingerprint | None = Fingerprint(0, self._hash.hexdigest()) if prefix == 0 else None

    def add(self, rec: InputRecord) -> None:
        data = _content(rec)
        self._hash.update(len(data).to_bytes(8, "little"))
        self._hash.update(data)
        self.records += 1
        if self.records == self._prefix_at:
            self.prefix = self.result()

    def result(self) -> Fingerprint:
        return Fingerprint(self.records, self._hash.hexdigest())


def fingerprint(records: Iterable[InputRecord]) -> Fingerprint:
    builder = FingerprintBuilder()
    for rec in records:
        builder.add(rec)
    return builder.result()


def read_sidecar(output: str) -> Fingerprint | None:
    try:
        obj = orjson.loads(sidecar_path(output).read_bytes())
        return Fingerprint(int(obj["records"]), str(obj["xxh3_128"]))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def write_sidecar(output: str, fp: Fingerprint) -> None:
    """Replace the sidecar in one rename, so a crash leaves the old one or the new one.

    The temporary file is made new (``mkstemp``: exclusive, links not followed), so a link planted at its
    name is never written through; the rename replaces a link at the sidecar's name, not its target."""
    path = sidecar_path(output)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps({"records": fp.records, "xxh3_128": fp.digest}) + b"\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_same_input(output: str, stored: Fingerprint | None, seen: FingerprintBuilder) -> str | None:
    """Raise InputMismatch unless IN starts with the records that produced OUT (``stored``, read from the
    sidecar before IN was read into ``seen``, built with ``prefix=stored.records``); a note if that is unknown."""
    if stored is None:
        return (f"note: {sidecar_path(output)} is missing or unreadable, so it cannot be checked that IN is the "
                "input that produced OUT")
    if seen.records < stored.records:
        raise InputMismatch(f"IN has {seen.records} records but the input that produced OUT had {stored.records} "
                            f"({sidecar_path(output)}); pass --force-resume to resume anyway")
    if seen.prefix is None or seen.prefix.digest != stored.digest:
        raise InputMismatch(f"IN is not the input that produced OUT: its first {stored.records} records differ "
                            f"({sidecar_path(output)}); write to a new OUT, or pass --force-resume to resume anyway")
    return None
