"""Printing: result lines on stdout, time-stamped progress on stderr, number formats, Markdown tables, and the
JSON a run leaves in ``$OUT`` (the device machine's folder that comes back)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()  # the script's start, for the progress time stamps and --time-budget


def say(msg: str = "") -> None:
    """Results: stdout."""
    print(msg, flush=True)


def log(msg: str) -> None:
    """Progress: stderr, time-stamped from the start of the script."""
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fmt_int(x: Any) -> str:
    return f"{int(x):,}" if isinstance(x, (int, float)) else "n/a"


def fmt_f(x: Any, digits: int = 2) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else "n/a"


def md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def md_table(header: list[str], rows: list[list[Any]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(header)))
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def out_path(name: str) -> Path | None:
    """``$OUT/name``, or None when ``$OUT`` is not set (a run on this machine keeps its figures on stdout)."""
    return Path(os.environ["OUT"], name) if os.environ.get("OUT") else None


def write_json(path: Path | None, data: Any) -> None:
    """``data`` as JSON at ``path`` (nothing if None), whole or not at all: a run cut short keeps the last copy."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log(f"could not write {path}: {exc}")
