"""Where `bench` and `probe-memory` results go: checked before the run, and never lost to a failed write.

A run takes minutes; its destination (``--output FILE``, stdout for ``--json``) is checked before it
starts, and if writing the result still fails at the end (a full disk, a closed pipe) the one-line error
comes with the result itself on stderr.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Callable

import orjson
from rich.console import Console

from llmcli.cli.io.output_checks import stdout_open
from llmcli.cli.progress import say
from llmcli.cli.usage_error import UsageError


def check_destination(output: Path | None, as_json: bool) -> None:
    """Raise UsageError when the result could not be written (before anything runs)."""
    if as_json and not stdout_open():
        raise UsageError("--json prints the result on stdout, which is closed; keep stdout open or use --output FILE")
    if output is None:
        return
    folder = output.parent if str(output.parent) else Path(".")
    if output.is_dir():
        raise UsageError(f"--output {output} is a folder")
    if not folder.is_dir():
        raise UsageError(f"--output {output}: the folder {folder} does not exist")
    target = output if output.exists() else folder
    if not os.access(target, os.W_OK):
        raise UsageError(f"--output {output}: {target} is not writable")


def deliver(result: dict[str, Any], output: Path | None, stdout: BinaryIO | None, console: Console) -> int:
    """Write ``result`` to ``output`` (indented JSON) and ``stdout`` (one line); 1, with the result on stderr,
    if a write fails."""
    targets: list[tuple[str, Callable[[], Any]]] = []
    if output is not None:
        targets.append((f"--output {output}",
                        lambda: output.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2, default=str)
                                                   + b"\n")))
    if stdout is not None:
        targets.append(("stdout", lambda: (stdout.write(orjson.dumps(result, default=str) + b"\n"), stdout.flush())))
    failed = []
    for where, write in targets:
        try:
            write()
        except OSError as exc:
            failed.append(f"writing the result to {where} failed ({exc.strerror or exc})")
    if not failed:
        return 0
    say(console, "error: " + "; ".join(failed) + "; the result follows on stderr")
    console.file.write(orjson.dumps(result, default=str).decode() + "\n")
    return 1
