"""Watching subprocesses in tests: output lines appearing, child processes, processes going away."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def env() -> dict[str, str]:
    """The environment for an ``llmcli`` subprocess: this checkout importable, no network, one thread each."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return e


def compiled_without_interpreter(script: str, timeout: float = 300.0) -> str:
    """Run a kernel-compiling ``script`` in a fresh process without Triton's interpreter (which accepts code the
    compiler rejects); its stdout. Skips where this Triton has no NVIDIA backend to compile with."""
    import sys

    import pytest

    if "nvidia" not in __import__("triton.backends").backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    e = env()
    e.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def wait_for_lines(proc: subprocess.Popen, out: Path, at_least: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= at_least:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early with {proc.returncode}: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("no output line appeared in time")


def child_processes(pid: int) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of each child of ``pid``, multiprocessing's resource tracker left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and "resource_tracker" not in cmdline:
            found.append((int(entry), fields[0], cmdline))
    return found


def children_of(pid: int) -> list[int]:
    """Live (not zombie) children of ``pid``."""
    return [child for child, state, _ in child_processes(pid) if state != "Z"]


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids that still exist (and are not zombies) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
