"""A time limit on a pure-Python call in the calling thread (a chat template's rendering).

Jinja compiles a template to Python code, so a template that loops for ever
(nested ``range(99999)``: the sandbox caps each range, not their product)
runs bytecode that can be interrupted: a watcher thread raises ``TimeLimitExceeded``
in the rendering thread (``PyThreadState_SetAsyncExc``) once its deadline has
passed. No process or thread is spawned per call; the watcher is one daemon
thread, started the first time a limit is set.
"""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class TimeLimitExceeded(BaseException):
    """The call did not finish within its time limit (a BaseException: the code interrupted, a template
    engine's ``except Exception``, must not swallow it)."""


def _set_async_exc(thread: int, exc: type[BaseException] | None) -> None:
    # None clears an exception set but not yet raised.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None if exc is None else ctypes.py_object(exc))


class _Watcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._active: dict[object, tuple[int, float]] = {}  # token -> (thread id, deadline)
        self._started = False

    def add(self, token: object, seconds: float) -> None:
        with self._lock:
            self._active[token] = (threading.get_ident(), time.monotonic() + seconds)
            if not self._started:
                threading.Thread(target=self._run, name="llmcli-time-limit", daemon=True).start()
                self._started = True
            self._wake.notify()

    def remove(self, token: object) -> bool:
        """Forget ``token``; False when its limit already fired (its exception is then delivered or cleared)."""
        with self._lock:
            if self._active.pop(token, None) is not None:
                return True
            _set_async_exc(threading.get_ident(), None)  # not yet delivered: the call ended in time after all
            return False

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for token, (thread, deadline) in list(self._active.items()):
                    if deadline <= now:
                        del self._active[token]  # fires once: remove() then knows
                        _set_async_exc(thread, TimeLimitExceeded)
                soonest = min((d for _, d in self._active.values()), default=None)
                self._wake.wait(None if soonest is None else max(0.0, soonest - now))


_WATCHER = _Watcher()


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeLimitExceeded`` in this thread if the block runs past ``seconds``. Only Python code is
    interrupted (a C call that never returns is not); the block must not swallow the exception."""
    token = object()
    _WATCHER.add(token, seconds)
    try:
        yield
    finally:
        in_time = _WATCHER.remove(token)
    if not in_time:
        raise TimeLimitExceeded(f"did not finish within {seconds:g} s")
