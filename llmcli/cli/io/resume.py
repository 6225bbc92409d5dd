"""Reading an existing OUT for --resume: which inputs it answers, after cutting off a torn last line."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from llmcli.cli.io.records import output_key


class ResumeError(ValueError):
    """OUT cannot be resumed safely (a damaged line that is not the last one)."""


@dataclass
class ResumeState:
    answered: set[str] = field(default_factory=set)  # resume keys (see records.record_key)
    num_lines: int = 0
    truncated_bytes: int = 0  # size of the torn last line that was cut off


def scan_output(path: Path | str) -> ResumeState:
    """Keys of every input OUT already answers; a torn last line is truncated away in place."""
    path = Path(path)
    state = ResumeState()
    if not path.exists():
        return state
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        # A kill mid-write leaves a line without its newline: it was never final.
        state.truncated_bytes = len(data) - end
        os.truncate(path, end)
        data = data[:end]
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ResumeError(f"{path}:{number}: not valid JSON ({exc}); cannot tell which inputs it answers") from None
        key = output_key(obj) if isinstance(obj, dict) else None
        if key is None:
            raise ResumeError(f"{path}:{number}: names no input (no id or custom_id); is this an llmcli output file?")
        state.answered.add(key)
        state.num_lines += 1
    return state
