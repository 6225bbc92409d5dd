"""The local Ray cluster goes down with the driver, even a SIGKILLed one: a watcher that kills what Ray leaves.

Ray ties its own daemons (gcs_server, raylet, ...) to the driver that started them, but the raylet's agents
(DashboardAgent, RuntimeEnvAgent) only notice their raylet is gone a minute or so later. This file runs as a
plain script (no llmcli import, so no torch), started by the driver with a pipe on stdin: while the pipe is
open it notes the raylet's children; when it closes (the driver exited, however) it kills those still
running. Each is named by pid and start time, so a recycled pid is never hit.
"""
from __future__ import annotations

import os
import select
import signal
import sys
from pathlib import Path

POLL_S = 0.5


def _children(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of each child of ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add((int(entry), fields[19]))
    return found


def _started(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def watch(raylet: int) -> None:
    seen: set[tuple[int, str]] = set()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 64):
            break  # the driver is gone (or shut Ray down and closed the pipe)
        seen |= _children(raylet)
    for pid, started in seen:
        if _started(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the driver is not for its watcher
    watch(int(sys.argv[1]))
