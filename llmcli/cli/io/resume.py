"""Reading an existing OUT for --resume: which inputs it answers, after cutting off a torn last line.

OUT is read one line at a time, so memory never grows with anything but the
longest line; anything but a regular file is refused before reading.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from llmcli.cli.io.records import output_key


class ResumeError(ValueError):
    """OUT cannot be resumed safely (a damaged line that is not the last one)."""


@dataclass
class ResumeState:
    answered: set[str] = field(default_factory=set)  # resume keys (see records.record_key)
    num_lines: int = 0
    errors: int = 0  # answered by an error record: the run that wrote them failed, and so does the resume
    truncated_bytes: int = 0  # size of the torn last line that was cut off


def is_error_line(obj: dict[str, Any]) -> bool:
    """An output line that reports a failed input (plain error record, or an OpenAI 4xx/5xx)."""
    if obj.get("error") is not None:
        return True
    response = obj.get("response")
    return isinstance(response, dict) and isinstance(response.get("status_code"), int) \
        and response["status_code"] >= 400


def scan_output(path: Path | str) -> ResumeState:
    """Keys of every input OUT already answers; a torn last line is truncated away in place."""
    path = Path(path)
    state = ResumeState()
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return state
    if not stat.S_ISREG(mode):
        raise ResumeError(f"--resume needs OUT to be a regular file; {path} is not")
    with open(path, "rb") as f:
        end = 0  # just past the last newline
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                # A kill mid-write leaves a line without its newline: it was never final.
                state.truncated_bytes = len(line)
                break
            end += len(line)
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ResumeError(f"{path}:{number}: not valid JSON ({exc}); "
                                  "cannot tell which inputs it answers") from None
            key = output_key(obj) if isinstance(obj, dict) else None
            if key is None:
                raise ResumeError(f"{path}:{number}: names no input (no id or custom_id); "
                                  "is this an llmcli output file?")
            state.answered.add(key)
            state.num_lines += 1
            state.errors += is_error_line(obj)
    if state.truncated_bytes:
        os.truncate(path, end)
    return state
