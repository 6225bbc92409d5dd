"""Engine start-up bookkeeping: a clock per phase, a way to abandon start-up between phases, compile caches."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class StartupCancelled(Exception):
    """Start-up was abandoned between two phases (the caller no longer needs the engine)."""


class StartupClock:
    """Seconds spent in each start-up phase, in the order they ran.

    ``cancelled`` is asked before every phase: the CLI builds the engine in a
    thread while it reads the input, and a bad input (or Ctrl-C) should not
    have to wait for the compile pass and graph capture of an engine it will
    shut down at once.
    """

    def __init__(self, cancelled: Callable[[], bool] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._cancelled = cancelled

    def check(self) -> None:
        if self._cancelled is not None and self._cancelled():
            raise StartupCancelled("engine start-up was cancelled")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.check()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


def compile_cache_dir() -> Path:
    """Where Inductor and Triton keep compiled kernels between runs (``$XDG_CACHE_HOME/llmcli``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmcli"


def use_persistent_compile_cache() -> None:
    """Point Inductor's and Triton's caches under the user's cache folder unless the user chose them.

    Inductor's default lives in /tmp, which many machines wipe on reboot; a warm
    cache is what makes the second start-up on a machine fast. ``LLMCLI_COMPILE_CACHE=0``
    leaves both libraries' defaults alone. Must run before the first compilation.
    """
    if os.environ.get("LLMCLI_COMPILE_CACHE", "1") == "0":
        return
    root = compile_cache_dir()
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if not os.environ.get(var):
            try:
                (root / sub).mkdir(parents=True, exist_ok=True)
            except OSError:
                continue  # a read-only home: keep the library's default
            os.environ[var] = str(root / sub)
