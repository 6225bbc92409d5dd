"""llmcli in a subprocess, watched from outside: its command line with the logger on, its process tree, each GPU's
memory (nvidia-smi, sampled while it runs); and a script's printed result."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# The command line of ``llmcli``, with the llmcli logger at INFO on stderr (the CLI itself shows warnings only).
CLI = ("import logging, sys\n"
       "handler = logging.StreamHandler()\n"
       "handler.setFormatter(logging.Formatter('llmcli log %(levelname)s: %(message)s'))\n"
       "logger = logging.getLogger('llmcli'); logger.addHandler(handler); logger.setLevel(logging.INFO)\n"
       "sys.argv[0] = 'llmcli'\n"
       "from llmcli.cli.app import main\n"
       "main()\n")


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid``, each with its parent (the driver's children are its replicas)."""
    from processes import children_of  # tests/processes.py: the caller puts tests/ on sys.path

    found: dict[int, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child in children_of(parent):
            found[child] = parent
            frontier.append(child)
    return found


def watch_command(proc: subprocess.Popen, timeout_s: float) -> tuple[dict[int, int], bool, float]:
    """Wait for ``proc``, collecting its process tree. Returns (every descendant seen, with its parent; whether
    ``timeout_s`` ran out, the process then killed; seconds)."""
    seen: dict[int, int] = {}
    start = time.monotonic()
    while proc.poll() is None:
        seen.update(descendants(proc.pid))
        if time.monotonic() > start + timeout_s:
            proc.kill()
            proc.wait()
            return seen, True, round(time.monotonic() - start, 1)
        time.sleep(0.1)
    return seen, False, round(time.monotonic() - start, 1)


def run_child(code: str, arg: dict[str, Any], env: dict[str, str] | None = None, timeout_s: float = 900) -> dict:
    """``python -c code json(arg)`` in a fresh process: its ``RESULT {json}`` line, with the wall time and, where
    the child reports the epoch time its engine was ready (``ready_epoch``), the seconds from the launch to it
    (interpreter start and imports included). Exits with the child's stderr when it fails."""
    launched, start = time.time(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], capture_output=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})}, cwd=REPO)  # this checkout's llmcli first
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0 or "RESULT " not in out:
        raise SystemExit(f"child run failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')[-3000:]}")
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    ready = result.get("ready_epoch", launched)
    return dict(result, wall_s=time.perf_counter() - start, from_launch_s=ready - launched)


def gpu_memory_mib() -> dict[str, int]:
    """Used memory of every GPU on the machine, by nvidia-smi index; empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines()] if done.returncode == 0 else []
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and r[1].isdigit()}


class GpuWatch:
    """Samples nvidia-smi while a command runs: peak memory of each GPU."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.enabled = bool(gpu_memory_mib())
        self.gpu_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        for gpu, mib in gpu_memory_mib().items():
            self.gpu_peak[gpu] = max(self.gpu_peak.get(gpu, 0), mib)

    def __enter__(self) -> "GpuWatch":
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-watch")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
