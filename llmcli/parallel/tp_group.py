"""The worker processes of one tensor-parallel engine: start-up bookkeeping, watchdog, calls, teardown.

``Group`` owns everything that must be released whatever happens (the spawned
ranks, the shared-memory control channel, the rendezvous store, the process
group) and the failure state that turns a dead or raising worker into a
``TensorParallelError`` naming the rank. ``llmcli.parallel.tp_runner``
builds one per engine; see its docstring for the failure handling in order.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
from typing import Any, Iterator

from llmcli.engine.startup_errors import TAG, from_text, plain_error
from llmcli.parallel.exits import describe_ended
from llmcli.parallel.heartbeat import DEFAULT_HEARTBEAT_S, HEARTBEAT_ENV, SilenceMonitor
from llmcli.parallel.shm_channel import ControlChannel, PayloadTooLarge
from llmcli.parallel.worker import PG_CLOSE_TIMEOUT_S, close_process_group

log = logging.getLogger("llmcli")

STORE_HOST = "127.0.0.1"
SHUTDOWN_WAIT_S = 5.0
FAILURE_SETTLE_S = 2.0
FAILED_CLOSE_TIMEOUT_S = 3.0  # leaving the group after a failure: the peers are dead, nothing is worth waiting for
INTERRUPTED_EXIT_STATUS = 130  # what a shell reports for a process ended by Ctrl-C


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the message names the rank and why. The group cannot be used again."""


def env_seconds(name: str, default: float) -> float:
    from llmcli.config import env_number

    return float(env_number(name, default))


class Group:
    """The processes, channel and rendezvous of one engine, and their failure state.

    Holds no reference to the runner, so the runner can be garbage collected
    and its finalizer (``teardown``) still has everything it needs.
    """

    def __init__(self, world: int, grace_s: float, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.world = world
        self.grace_s = grace_s
        self.silence = SilenceMonitor(heartbeat_s)
        self.procs: dict[int, Any] = {}  # rank -> multiprocessing.Process
        self.channel: ControlChannel | None = None
        self.store: Any = None
        self.pg_owned = False
        self.lock = threading.Lock()
        self.failure: str | None = None  # first worker death, as reported to the user
        self.failed_rank: int | None = None
        self.start_up_error: Exception | None = None  # that worker's one-line error (a damaged checkpoint...)
        self.broken: str | None = None  # rank 0 itself failed mid-call: workers may be stuck in a collective
        self.interrupted = False  # that failure was a KeyboardInterrupt (Ctrl-C)
        self.closing = False
        self.torn_down = False
        self.in_call: str | None = None
        self.call_number = 0
        self.pg_stuck = False  # leaving the process group did not finish: a thread is still inside NCCL
        self.watchdog: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()

    # -- failures -----------------------------------------------------------------
    def worker_exited(self, rank: int) -> None:
        """Record the first unexpected worker exit and take the other workers down."""
        if self.closing:
            return
        with self.lock:
            if self.failure is not None:
                return
            proc = self.procs[rank]
            message = f"tensor-parallel rank {rank} (pid {proc.pid}) {describe_ended(proc)}"
            try:
                error = self.channel.read_error(rank).strip() if self.channel is not None else ""
            except (ValueError, OSError):  # the segment is already closed
                error = ""
            self.start_up_error = from_text(error)
            error = "\n".join(line for line in error.splitlines() if not line.startswith(TAG))
            if error:
                message += f"; its error:\n{error}"
            elif proc.exitcode is not None and proc.exitcode > 0:
                message += (" without reporting an error from llmcli's worker code (see its output above). "
                            "Workers are started with multiprocessing's 'spawn' method, which imports your main "
                            "script again: a script that creates the LLM at import time must do it under "
                            "`if __name__ == \"__main__\":`")
            self.failed_rank, self.failure = rank, message
        # Reported once, by the TensorParallelError of rank 0's call (or by _hard_exit), not here as well.
        log.info("llmcli: %s", message)
        for other, p in self.procs.items():
            if other != rank and p.is_alive():
                p.kill()  # a collective with a dead member fails fast only once every peer is gone

    def worker_silent(self, rank: int, seconds: float, doing: str) -> None:
        """A rank alive but silent past the heartbeat limit fails the group like a dead one."""
        if self.closing:
            return
        with self.lock:
            if self.failure is not None:
                return
            pid = self.procs[rank].pid
            self.failed_rank = rank
            self.failure = (f"tensor-parallel rank {rank} (pid {pid}) stopped responding while {doing or 'starting'}:"
                            f" no heartbeat for {seconds:.1f} s ({HEARTBEAT_ENV}={self.silence.limit_s:g}); "
                            "it may have been stopped (SIGSTOP) or be frozen")
        log.info("llmcli: %s", self.failure)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()  # the silent one too (SIGKILL ends a stopped process), so rank 0's collective fails fast

    def poll_workers(self) -> None:
        # the sentinel, not the exit status: the status can lag it by seconds on a loaded machine (longer than
        # rank 0's FAILURE_SETTLE_S wait after a communication error), and reading it here would reap the child
        # under the watchdog's feet, which is then left with no status to report
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs.values()], timeout=0)
        for rank, proc in self.procs.items():
            if proc.sentinel in ended:
                self.worker_exited(rank)

    def check(self) -> None:
        """Raise if the group cannot take another call."""
        if self.failure is not None:
            if self.start_up_error is not None:  # every rank reads the same files: the error is the model's
                raise self.start_up_error
            raise TensorParallelError(f"{self.failure}\nThe tensor-parallel group has stopped; "
                                      "create a new engine to continue.")
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is unusable after an earlier error "
                                      f"({self.broken}); create a new engine to continue")
        if self.torn_down:
            raise TensorParallelError("the tensor-parallel engine has been shut down")

    def check_alive(self) -> None:
        self.poll_workers()
        self.check()

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """After a communication error on rank 0: the dead worker that explains it, if one shows up."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll_workers()
            if self.failure is not None or time.monotonic() >= deadline:
                return self.failure
            time.sleep(0.02)

    # -- the watchdog ---------------------------------------------------------------
    def start_watchdog(self) -> None:
        self.watchdog = threading.Thread(target=self._watch, name="llmcli-tp-watchdog", daemon=True)
        self.watchdog.start()

    def _watch(self) -> None:
        pending = {proc.sentinel: rank for rank, proc in self.procs.items()}
        while pending:
            ready = multiprocessing.connection.wait(list(pending) + [self._wake_r], timeout=self.silence.tick_s)
            if self.closing or self._wake_r in ready:
                return
            for sentinel in ready:
                rank = pending.pop(sentinel, None)
                if rank is not None:
                    self.worker_exited(rank)
            if self.failure is None and self.channel is not None:
                silent = self.silence.silent(self.channel, sorted(pending.values()))
                if silent is not None:
                    self.worker_silent(silent.rank, silent.seconds, silent.doing)
            if self.failure is not None:
                self._grace_for_rank0()

    def _grace_for_rank0(self) -> None:
        """Rank 0 must leave its current call soon after a worker died; if it cannot, end the process."""
        call = self.call_number if self.in_call else None
        if call is None:
            return
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            if self.closing or not self.in_call or self.call_number != call:
                return
            time.sleep(0.05)
        self._hard_exit()

    def _hard_exit(self) -> None:
        text = (f"llmcli: {self.failure}\nllmcli: rank 0 is still blocked in '{self.in_call}' "
                f"{self.grace_s:.0f} s later and cannot recover; stopping every rank and exiting.\n")
        try:
            os.write(2, text.encode("utf-8", "replace"))
        except OSError:
            pass
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.kill()
        if self.channel is not None:
            self.channel.unlink()
        os._exit(1)

    # -- calls ------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Wrap one rank-0 call: refuse if the group is down, turn a peer's death into TensorParallelError."""
        # in_call is set before the check: the watchdog records a death first and reads in_call second,
        # so either this check sees the death or the watchdog sees the call (and enforces the grace period)
        self.call_number += 1
        outer, self.in_call = self.in_call, what  # nested: a constrained step reads the last one back mid-launch
        try:
            self.check()
            yield
        except (TensorParallelError, PayloadTooLarge):
            raise
        except KeyboardInterrupt:
            self.broken, self.interrupted = f"interrupted during {what}", True
            raise
        except BaseException as exc:
            failure = self.wait_for_failure(FAILURE_SETTLE_S)
            if failure is not None:
                if self.start_up_error is not None:
                    raise self.start_up_error from None
                if plain_error(exc) is not None:  # rank 0 met the same damaged checkpoint (or config)
                    raise
                raise TensorParallelError(f"{failure}\n(rank 0 saw: {type(exc).__name__}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
            self.broken = f"rank 0 raised {type(exc).__name__} during {what}"
            raise
        finally:
            self.in_call = outer

    # -- teardown ---------------------------------------------------------------
    def teardown(self) -> None:
        """Release every rank, the process group, the store and the segment (idempotent)."""
        with self.lock:
            if self.torn_down:
                return
            self.torn_down = True
        self.poll_workers()
        clean = bool(self.failure is None and self.broken is None and self.in_call is None and self.procs
                     and all(p.is_alive() for p in self.procs.values()))
        self.closing = True
        started = time.monotonic()
        log.debug("tensor-parallel teardown (%s)", "clean" if clean else "after a failure")
        if clean and self.channel is not None:
            deadline = time.monotonic() + SHUTDOWN_WAIT_S

            def give_up() -> None:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs.values()):
                    raise TimeoutError

            try:
                self.channel.post("shutdown", (), give_up)
            except (TimeoutError, OSError, ValueError):
                clean = False
        if not clean:
            # A worker may be blocked in a collective that rank 0 will never join; on two H200s rank 0's NCCL
            # abort then did not return (runs 9-10 in benchmarks/RESULTS.md). Workers go first, unasked.
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
        limit = PG_CLOSE_TIMEOUT_S if clean else FAILED_CLOSE_TIMEOUT_S
        if self.pg_owned and not close_process_group(limit):
            self.pg_stuck = True
            log.warning("the tensor-parallel process group did not close within %.0f s; leaving it behind "
                        "(this process will end without running C++ clean-up, which would abort)", limit)
        self.pg_owned = False
        log.debug("tensor-parallel teardown: process group left after %.1f s", time.monotonic() - started)
        deadline = time.monotonic() + (SHUTDOWN_WAIT_S if clean else 0.0)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(SHUTDOWN_WAIT_S)
        log.debug("tensor-parallel teardown: workers gone after %.1f s", time.monotonic() - started)
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self.watchdog.join(SHUTDOWN_WAIT_S)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for proc in self.procs.values():
            with contextlib.suppress(ValueError):
                proc.close()
        if self.channel is not None:
            self.channel.close()
            self.channel.unlink()
            # With "spawn", each semaphore is a named POSIX semaphore (/dev/shm/sem.mp-*), unlinked when the object
            # is collected: drop the only references (the worker args share these lists).
            self.channel.spec.commands.clear()
            self.channel.spec.acks.clear()
        self.store = None
        if not self.pg_stuck:
            atexit.unregister(self.at_exit)

    def at_exit(self) -> None:
        """Interpreter exit: tear down if nobody did; if leaving the process group got stuck, end the
        process here. C++ destructors would otherwise run under the thread still inside NCCL and abort
        the process (SIGABRT, "terminate called without an active exception")."""
        self.teardown()
        if self.pg_stuck:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            # a Ctrl-C that landed in rank 0's own code, between two calls to the ranks, is one too: the
            # interpreter keeps the exception that is ending it in sys.last_value
            interrupted = self.interrupted or isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
            os._exit(INTERRUPTED_EXIT_STATUS if interrupted else 1)
