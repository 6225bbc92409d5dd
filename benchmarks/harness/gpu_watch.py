"""Memory of the GPUs seen from outside the processes that use them: nvidia-smi, sampled while a command runs."""
from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any


def nvidia_smi(*query: str) -> list[list[str]] | None:
    """Rows of ``nvidia-smi --query-...`` (csv, no header, no units); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def gpu_memory_mib() -> dict[str, int]:
    """Used memory of every GPU on the machine, by nvidia-smi index."""
    rows = nvidia_smi("--query-gpu=index,memory.used") or []
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
