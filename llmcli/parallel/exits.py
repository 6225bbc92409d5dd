"""How a worker or replica process ended, in words for an error message."""
from __future__ import annotations

import signal
import time
from typing import Any

# A process's sentinel fires when its files close, which comes before the kernel makes it reapable; on a loaded
# 2-core CI machine that gap passed 0.5 s (a worker that exited with status 1 was reported "not responding").
EXIT_SETTLE_S = 10.0


def describe_exit(code: int) -> str:
    """``multiprocessing`` exit code -> 'was killed by signal SIGKILL', 'exited with status 1', ..."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0:
        return "exited unexpectedly (status 0)"
    return f"exited with status {code}"


def describe_ended(proc: Any, settle_s: float = EXIT_SETTLE_S) -> str:
    """How a process whose sentinel fired ended, waiting up to ``settle_s`` for its exit status."""
    deadline = time.monotonic() + settle_s
    proc.join(settle_s)
    # join returns at once, status unknown, when another thread's poll reaped the child first (waitpid gives
    # ECHILD to the loser); that thread stores the status on the shared handle a moment later
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.exitcode is None:
        return "is exiting (no exit status yet)"
    return describe_exit(proc.exitcode)
