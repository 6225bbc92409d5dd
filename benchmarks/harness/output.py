"""Printing: result lines on stdout, time-stamped progress on stderr, number formats, Markdown tables."""
from __future__ import annotations

import sys
import time
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
