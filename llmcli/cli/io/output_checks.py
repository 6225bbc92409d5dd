"""What must hold of OUT before anything runs: the flags agree, stdout is open, OUT is not IN, OUT is writable."""
from __future__ import annotations

import os
import stat
import sys

from llmcli.cli.io.fingerprint import sidecar_path
from llmcli.cli.io.source import stream_open


class OutputError(Exception):
    """OUT cannot be used as asked; one line saying what to change."""


def stdout_open() -> bool:
    return stream_open(sys.stdout)


def _same_file(output: str, input: str) -> bool:
    try:
        out = os.stat(output)
        inp = os.fstat(sys.stdin.fileno()) if input == "-" else os.stat(input)
    except (OSError, AttributeError, ValueError):
        return False
    return stat.S_ISREG(out.st_mode) and os.path.samestat(out, inp)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _check_sidecar(output: str) -> None:
    """The fingerprint file is replaced by a rename at the end of the checks: something other than a file
    there (a folder, a link someone planted) would fail it after the model loaded, or mislead --resume."""
    path = sidecar_path(output)
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        raise OutputError(f"{path} (OUT's input fingerprint) is a symbolic link, which llmcli does not follow "
                          "(someone may have aimed it at another file); remove it and run again")
    if not stat.S_ISREG(mode):
        raise OutputError(f"{path} (OUT's input fingerprint) is {_kind(mode)}, not a file; remove it and run again")


def check_output(output: str, input: str, resume: bool, overwrite: bool) -> None:
    """Raise OutputError unless OUT can take this run's records (before the model loads)."""
    if resume and overwrite:
        raise OutputError("--resume and --overwrite contradict each other: --resume keeps OUT's records, "
                          "--overwrite replaces them; give one")
    if output == "-":
        if not stdout_open():
            raise OutputError("stdout is closed, so -o - has nowhere to write; give -o FILE or keep stdout open")
        return
    if _same_file(output, input):
        raise OutputError(f"IN and OUT are the same file ({output}); write the answers to another file")
    _check_sidecar(output)
    try:
        mode = os.stat(output).st_mode
    except FileNotFoundError:
        if os.path.islink(output) and not os.path.isdir(os.path.dirname(os.path.realpath(output))):
            raise OutputError(f"OUT {output} is a symbolic link to {os.path.realpath(output)}, whose folder "
                              "does not exist") from None
        return  # creating it needs the folder, which the lock file (made first) already proved writable
    except OSError as exc:
        raise OutputError(f"cannot use OUT {output}: {exc.strerror or exc}") from None
    if resume and not stat.S_ISREG(mode):
        raise OutputError(f"--resume needs OUT to be a regular file; {output} is {_kind(mode)}")
    if stat.S_ISDIR(mode):
        raise OutputError(f"OUT {output} is a folder")
    try:
        with open(output, "ab"):  # exists already, so this changes nothing
            pass
    except OSError as exc:
        raise OutputError(f"cannot write OUT {output}: {exc.strerror or exc}") from None


def describe_write_failure(output: str, written: int, exc: BaseException) -> str:
    """The one line for a write to OUT that failed mid-run (disk full, I/O error)."""
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if output == "-" or not os.path.isfile(output):
        where = "stdout" if output == "-" else f"OUT {output}"
        return f"writing to {where} failed ({why}) after {written} records were written"
    return (f"writing OUT {output} failed ({why}) after {written} records were written this run; every record "
            "written is whole. Free space (or fix the cause) and run the same command with --resume to finish")
