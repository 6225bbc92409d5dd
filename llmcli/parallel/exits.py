"""How a worker or replica process ended, in words for an error message."""
from __future__ import annotations

import signal


def describe_exit(code: int | None) -> str:
    """``multiprocessing`` exit code -> 'was killed by signal SIGKILL', 'exited with status 1', ..."""
    if code is None:
        return "is not responding"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0:
        return "exited unexpectedly (status 0)"
    return f"exited with status {code}"
