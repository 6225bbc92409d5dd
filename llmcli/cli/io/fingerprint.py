"""Which input produced OUT: a small fingerprint in a sidecar file (``OUT.llmcli-input``) that --resume checks.

The fingerprint is the number of input records and a hash of their content
(id or line position, prompt, per-record fields) in order, not of the file's
bytes: reformatting a line or adding blank lines changes nothing. A resume
accepts an input whose first records are exactly the ones that produced OUT,
so appending new lines to IN and resuming runs just the new ones; anything
else is refused unless ``--force-resume``.
"""
from __future__ import annotations

import os
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


def fingerprint(records: Iterable[InputRecord]) -> Fingerprint:
    h, n = xxhash.xxh3_128(), 0
    for rec in records:
        data = _content(rec)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        n += 1
    return Fingerprint(n, h.hexdigest())


def read_sidecar(output: str) -> Fingerprint | None:
    try:
        obj = orjson.loads(sidecar_path(output).read_bytes())
        return Fingerprint(int(obj["records"]), str(obj["xxh3_128"]))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def write_sidecar(output: str, fp: Fingerprint) -> None:
    """Replace the sidecar in one rename, so a crash leaves the old one or the new one."""
    path = sidecar_path(output)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(orjson.dumps({"records": fp.records, "xxh3_128": fp.digest}) + b"\n")
    os.replace(tmp, path)


def check_same_input(output: str, records: list[InputRecord]) -> str | None:
    """Raise InputMismatch unless IN starts with the records that produced OUT; a note if that is unknown."""
    stored = read_sidecar(output)
    if stored is None:
        return (f"note: {sidecar_path(output)} is missing or unreadable, so it cannot be checked that IN is the "
                "input that produced OUT")
    if len(records) < stored.records:
        raise InputMismatch(f"IN has {len(records)} records but the input that produced OUT had {stored.records} "
                            f"({sidecar_path(output)}); pass --force-resume to resume anyway")
    if fingerprint(records[:stored.records]).digest != stored.digest:
        raise InputMismatch(f"IN is not the input that produced OUT: its first {stored.records} records differ "
                            f"({sidecar_path(output)}); write to a new OUT, or pass --force-resume to resume anyway")
    return None
