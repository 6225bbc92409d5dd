"""``llmcli`` as a subprocess, watched from outside: the command line with its logger on, and its process tree."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from processes import children_of  # tests/processes.py: the caller puts tests/ on sys.path

# The command line of ``llmcli``, with the llmcli logger at INFO on stderr (the CLI itself shows warnings only).
CLI = ("import logging, sys\n"
       "handler = logging.StreamHandler()\n"
       "handler.setFormatter(logging.Formatter('llmcli log %(levelname)s: %(message)s'))\n"
       "logger = logging.getLogger('llmcli'); logger.addHandler(handler); logger.setLevel(logging.INFO)\n"
       "sys.argv[0] = 'llmcli'\n"
       "from llmcli.cli.app import main\n"
       "main()\n")


def started_at(pid: int) -> int:
    """Start time of a process in clock ticks since boot (orders the replicas as they were spawned)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid``, each with its parent (the driver's children are its replicas)."""
    found: dict[int, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child in children_of(parent):
            found[child] = parent
            frontier.append(child)
    return found


def watch_command(proc: subprocess.Popen, out: Path, timeout_s: float, kill_after: int | None = None,
          ) -> tuple[dict[int, int], dict[str, Any], bool, float]:
    """Wait for ``proc``, collecting its process tree; with ``kill_after`` N, SIGKILL its second child (the
    second data-parallel replica) once OUT has N lines. Returns (every descendant seen, with its parent; the
    kill, if one landed; whether ``timeout_s`` ran out, the process then killed; seconds)."""
    seen: dict[int, int] = {}
    killed: dict[str, Any] = {}
    start = time.monotonic()
    while proc.poll() is None:
        seen.update(descendants(proc.pid))
        if kill_after is not None and not killed and out.exists():
            written = out.read_bytes().count(b"\n")
            replicas = sorted((p for p, parent in seen.items() if parent == proc.pid), key=started_at)
            if written >= kill_after and len(replicas) >= 2:
                os.kill(replicas[1], signal.SIGKILL)
                killed = {"pid": replicas[1], "lines_written_then": written, "after_s": round(time.monotonic() - start, 1)}
                print(f"   SIGKILL to replica pid {replicas[1]} with {written} records written", flush=True)
        if time.monotonic() > start + timeout_s:
            proc.kill()
            proc.wait()
            return seen, killed, True, round(time.monotonic() - start, 1)
        time.sleep(0.1)
    return seen, killed, False, round(time.monotonic() - start, 1)
