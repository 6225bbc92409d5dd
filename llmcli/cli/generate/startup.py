"""The engine's start-up in a thread, so that it overlaps reading, checking and tokenizing the input."""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from llmcli.engine.engine_api import EngineAPI

THREAD_NAME = "llmcli-engine-start-up"


def start_up_running() -> bool:
    """Whether an engine's start-up thread is still at work (a second Ctrl-C left it where it was)."""
    return any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


def leave_if_start_up_abandoned() -> None:
    """After a Ctrl-C: a second one leaves the engine's start-up thread where it is, perhaps inside C++ (a
    tensor-parallel rendezvous, a process group being made), and interpreter exit under it aborts (SIGABRT,
    "terminate called without an active exception"). Then the worker processes go now, the Python exit hooks
    run (the group's teardown, logging), the control segments are removed, and the process ends with 130
    without C++ clean-up. Everything else (OUT's lock, IN's copy) has been released by then."""
    if not start_up_running():
        return
    import atexit
    import multiprocessing

    from llmcli.parallel.shm_channel import unlink_own_segments

    for child in multiprocessing.active_children():
        child.kill()
    atexit._run_exitfuncs()
    unlink_own_segments()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(130)


class EngineStarter:
    """Runs ``build(cancelled)`` in a thread; ``result()`` waits for the engine, ``close()`` abandons it.

    ``cancelled`` is what the engine asks between its start-up phases, so a
    start-up that is no longer wanted (bad input, Ctrl-C) stops at the next
    phase; an engine that did finish starting is shut down (workers, shared
    memory and actors with it).
    """

    def __init__(self, build: Callable[[Callable[[], bool]], EngineAPI], *, in_thread: bool = True) -> None:
        """``in_thread=False`` builds at once in this thread (for what must start in the main thread)."""
        self._build = build
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._engine: EngineAPI | None = None
        self._error: BaseException | None = None
        if not in_thread:
            self._engine = build(self._cancel.is_set)
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._engine = self._build(self._cancel.is_set)
        except BaseException as exc:  # raised again by result()
            self._error = exc
        finally:
            self._done.set()

    def _wait(self) -> None:
        while not self._done.wait(0.1):  # short waits: Ctrl-C reaches the main thread at once
            pass

    def result(self) -> EngineAPI:
        """The engine, once started; start-up's own error if it failed."""
        self._wait()
        if self._error is not None:
            raise self._error
        assert self._engine is not None, "result() after close()"
        return self._engine

    def close(self) -> None:
        """Shut the engine down, stopping its start-up at the next phase if it is still starting."""
        self._cancel.set()
        self._wait()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
