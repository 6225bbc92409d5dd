"""The small files of a model folder read with errors that name the file and the cause (permission denied, a FIFO,
a dangling link, not JSON), whichever error class the caller reports them as."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any


def os_reason(exc: OSError) -> str:
    """``permission denied``, not Python's ``[Errno 13] Permission denied: '/path'``."""
    return (exc.strerror or str(exc)).lower() if exc.errno is not None else str(exc)


def check_readable_file(path: Path, what: str, error: type[Exception]) -> None:
    """Raise ``error`` unless ``path`` is a readable regular file: a FIFO or a device would block or never end.
    Opened once here, in Python, which lets Ctrl-C in while a slow mount answers."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        target = f" (a symbolic link to {os.readlink(path)}, which does not exist)" if os.path.islink(path) else ""
        raise error(f"{what} {path} does not exist{target}") from None
    except OSError as exc:
        raise error(f"{what} {path} cannot be used: {os_reason(exc)}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise error(f"{what} {path} is {kind}, not a regular file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise error(f"{what} {path} cannot be read: {os_reason(exc)}") from None


def read_json(path: Path, error: type[Exception], fix: str = "") -> Any:
    """The JSON value in ``path``; ``error`` naming it when it cannot be read or parsed (``fix``: what to do)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path} cannot be read: {os_reason(exc)}") from None
    except ValueError as exc:
        raise error(f"{path} is not valid JSON ({exc}){fix}") from None


def json_kind(value: Any) -> str:
    return "null" if value is None else {"list": "a list", "str": "a string"}.get(type(value).__name__,
                                                                                 type(value).__name__)
