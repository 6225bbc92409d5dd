"""Data-parallel replicas on this machine: one spawned process per replica, two pipes each.

Each replica process builds its own ``LLMEngine`` (with its own tensor-parallel
ranks when ``tensor_parallel_size`` > 1; on CUDA, replica r sees GPUs
r*tp .. r*tp+tp-1 of the driver's through ``CUDA_VISIBLE_DEVICES``, set before
torch touches CUDA in the child) and runs ``ReplicaLoop``. Requests go down one
pipe, answers come up another: separate pipes per replica, so a replica killed
in the middle of a write cannot leave a lock held that the others need. A
reader thread in the replica empties its request pipe continuously, so the
driver's sends never wait on a replica that is itself busy sending.

Loss: the driver waits on every replica's result pipe and process sentinel at
once; a sentinel that fires means the replica is gone (whatever it sent before
is still read). A replica also writes a heartbeat from a thread of its own, so
one that says nothing for ``LLMCLI_DP_HEARTBEAT_S`` is stopped or frozen, not
busy: it is lost too (and killed). The driver's sends go through a thread per
replica, so a stopped replica's full pipe never blocks the driver. Replicas ignore SIGINT (Ctrl-C reaches the whole process
group; the driver decides how to stop) and leave by themselves within half a
second when the driver's process disappears. ``shutdown`` (also at interpreter
exit and when the pool is garbage collected) asks them to stop, then kills
whatever is still there.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401 - its atexit hook must be registered before ours (ours runs first)
import os
import queue
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from llmcli.engine.cpu_threads import THREADS_ENV, replica_budget
from llmcli.scaleout.errors import DataParallelError, raise_startup_failure
from llmcli.scaleout.replica import (ADD, STOP, ReplicaInfo, ReplicaLoop, build_engine, describe,
                                     failure_text, running_ids, silence_limit_s, silence_text,
                                     startup_failure)
from llmcli.parallel.exits import describe_ended
from llmcli.parallel.heartbeat import beat_interval

log = logging.getLogger("llmcli")

PARENT_POLL_S = 0.5
STOP_WAIT_S = 10.0


@dataclass
class ReplicaSpec:
    index: int
    engine_kwargs: dict[str, Any]
    threads: int | None
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)
    beat_s: float = 1.0  # how often the replica's heartbeat thread writes to its result pipe


# -- GPU placement -------------------------------------------------------------------
def visible_gpus(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The driver's GPUs, as entries for CUDA_VISIBLE_DEVICES: that variable's own list when it is set
    (indices or UUIDs, in its order), else every device CUDA counts."""
    if cuda_visible_devices is not None:
        return [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    return [str(i) for i in range(device_count)]


def replica_gpus(visible: list[str], size: int, tp: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: replica r gets visible[r*tp : r*tp+tp]. Too few GPUs is a
    configuration error, raised before any replica starts."""
    from llmcli.config import ConfigError

    need = size * tp
    if len(visible) < need:
        shown = ",".join(visible) if visible else "none"
        raise ConfigError(f"--data-parallel-size {size} x tensor_parallel_size {tp} needs {need} GPUs but "
                          f"{len(visible)} {'is' if len(visible) == 1 else 'are'} visible ({shown})")
    return [",".join(visible[r * tp:(r + 1) * tp]) for r in range(size)]


# -- the replica process ---------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(3)  # the driver is gone: nobody will read our answers (tensor-parallel ranks follow us)


def replica_main(spec: ReplicaSpec, requests: Any, results: Any) -> None:
    """Entry point of a spawned replica (``multiprocessing`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(spec.env)  # CUDA_VISIBLE_DEVICES: before anything initializes CUDA here
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True, name="llmcli-dp-parent").start()
    try:
        engine = build_engine(spec.engine_kwargs, spec.threads)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which decides what the user sees
        with contextlib.suppress(Exception):
            results.send(("failed", startup_failure(exc)))
        os._exit(1)
    send_lock = threading.Lock()

    def emit(outputs: list, stats: Any) -> None:
        with send_lock:
            results.send(("out", outputs, stats))

    def beat() -> None:  # its own thread, so a long step is not silence; only a stopped process is
        try:
            while True:
                time.sleep(spec.beat_s)
                with send_lock:
                    results.send(("beat",))
        except (OSError, ValueError):
            pass  # the driver is gone, or this replica is ending

    loop = ReplicaLoop(engine, emit)

    def read_requests() -> None:
        try:
            while True:
                loop.inbox.put(requests.recv())
        except (EOFError, OSError):
            loop.inbox.put((STOP,))  # the driver closed our pipe: nothing more will come

    try:
        results.send(("ready", describe(engine, spec.index)))
        threading.Thread(target=read_requests, daemon=True, name="llmcli-dp-inbox").start()
        threading.Thread(target=beat, daemon=True, name="llmcli-dp-heartbeat").start()
        loop.run()
    except BaseException as exc:  # noqa: BLE001
        text = failure_text(exc)
        sent = False
        with contextlib.suppress(Exception):
            results.send(("died", text, running_ids(engine)))
            sent = True
        if not sent:  # the driver is gone: stderr is the only place left to say it
            sys.stderr.write(f"llmcli data-parallel replica {spec.index} failed:\n{text}\n")
            sys.stderr.flush()
        with contextlib.suppress(BaseException):
            engine.shutdown()  # its tensor-parallel ranks, segment and semaphores go with it, not to the tracker
        os._exit(1)
    try:
        engine.shutdown()
    finally:
        with contextlib.suppress(Exception):
            results.send(("bye",))


# -- the driver's side ---------------------------------------------------------------------
class _Replica:
    def __init__(self, index: int, proc: Any, requests: Any, results: Any) -> None:
        self.index = index
        self.proc = proc
        self.requests = requests  # driver -> replica
        self.results = results  # replica -> driver
        self.info: ReplicaInfo | None = None
        self.error_text = ""  # a traceback the replica sent before it exited
        self.suspects: list[Any] | None = None  # what it was running when it failed (None: it did not say)
        self.lost = False
        self.heard = time.monotonic()  # when the driver last read a message from it
        # Sends go through a thread of their own: a stopped replica stops emptying its pipe, and a send into
        # a full pipe would block the driver, which must stay free to notice the silence.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send_failed: str | None = None

    def start_sender(self) -> None:
        threading.Thread(target=self._send_loop, daemon=True, name=f"llmcli-dp-send{self.index}").start()

    def _send_loop(self) -> None:
        while True:
            message = self.outbox.get()
            try:
                self.requests.send(message)
            except (OSError, ValueError) as exc:  # BrokenPipeError and friends: it is gone
                self.send_failed = f"stopped taking requests ({type(exc).__name__})"
                return
            if message[0] == STOP:
                return


class _Procs:
    """The processes and pipes of one pool (no reference to the pool, so its finalizer can run after it)."""

    def __init__(self) -> None:
        self.replicas: list[_Replica] = []
        self.torn_down = False
        self.lock = threading.Lock()

    def teardown(self) -> None:
        with self.lock:
            if self.torn_down:
                return
            self.torn_down = True
        atexit.unregister(self.teardown)
        live = [r for r in self.replicas if r.proc.is_alive()]
        for r in live:
            r.outbox.put((STOP,))
        deadline = time.monotonic() + STOP_WAIT_S
        for r in live:
            r.proc.join(max(0.0, deadline - time.monotonic()))
        for r in self.replicas:
            if r.proc.is_alive():
                log.warning("llmcli: data-parallel replica %d (pid %s) did not stop within %.0f s; killing it",
                            r.index, r.proc.pid, STOP_WAIT_S)
                r.proc.kill()
            r.proc.join(5.0)
            for conn in (r.requests, r.results):
                with contextlib.suppress(Exception):
                    conn.close()
            with contextlib.suppress(ValueError):
                r.proc.close()


class LocalReplicaPool:
    """``size`` replica processes on this machine."""

    backend = "local"

    def __init__(self, engine_kwargs: dict[str, Any], size: int, *, device: str, tensor_parallel_size: int) -> None:
        self.engine_kwargs = engine_kwargs
        self.size = size
        self.device = device
        self.tp = tensor_parallel_size
        self._procs = _Procs()
        self._finalizer = weakref.finalize(self, self._procs.teardown)
        self._finalizer.atexit = False  # the explicit atexit hook below runs before multiprocessing's own
        self.silence_s = silence_limit_s()

    @property
    def replicas(self) -> list[_Replica]:
        return self._procs.replicas

    def gpu_sets(self) -> list[str]:
        """CUDA_VISIBLE_DEVICES of each replica: consecutive groups of tp devices of the driver's."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = 0
        if visible is None:
            import torch

            count = torch.cuda.device_count()
        return replica_gpus(visible_gpus(visible, count), self.size, self.tp)

    def start(self, timeout_s: float) -> list[ReplicaInfo]:
        """Spawn every replica and wait until all have built their engine; raise (after cleaning up) if one fails."""
        procs = self._procs
        atexit.register(procs.teardown)
        try:
            gpus = self.gpu_sets() if self.device == "cuda" else [None] * self.size
            # on CPU each replica gets its share of the cores as its thread budget (engine/cpu_threads.py)
            threads = replica_budget(self.size) if self.device == "cpu" else None
            ctx = multiprocessing.get_context("spawn")
            for index in range(self.size):
                req_r, req_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                env = {"CUDA_VISIBLE_DEVICES": gpus[index]} if gpus[index] is not None else {}
                if threads is not None:
                    env[THREADS_ENV] = str(threads)
                spec = ReplicaSpec(index, self.engine_kwargs, threads, os.getpid(), env, beat_interval(self.silence_s))
                proc = ctx.Process(target=replica_main, args=(spec, req_r, res_w), name=f"llmcli-dp-replica{index}")
                proc.start()
                req_r.close()
                res_w.close()  # ours closed, the replica's end is the only writer: EOF when it exits
                replica = _Replica(index, proc, req_w, res_r)
                replica.start_sender()
                procs.replicas.append(replica)
            return self._wait_ready(timeout_s)
        except BaseException:
            procs.teardown()
            raise

    def _wait_ready(self, timeout_s: float) -> list[ReplicaInfo]:
        deadline = time.monotonic() + timeout_s
        waiting = {r.results: r for r in self.replicas}
        waiting.update({r.proc.sentinel: r for r in self.replicas})
        while any(r.info is None for r in self.replicas):
            left = deadline - time.monotonic()
            if left <= 0:
                slow = [r.index for r in self.replicas if r.info is None]
                raise DataParallelError(f"data-parallel replica(s) {slow} did not start within {timeout_s:.0f} s "
                                        "(LLMCLI_DP_START_TIMEOUT_S)")
            for ready in multiprocessing.connection.wait(list(waiting), min(left, 1.0)):
                r = waiting[ready]
                message = None
                if ready is r.results:
                    try:
                        message = r.results.recv()
                    except (EOFError, OSError):
                        pass
                if message is not None and message[0] == "ready":
                    r.info = message[1]
                    r.heard = time.monotonic()
                    waiting.pop(r.results, None)
                    waiting.pop(r.proc.sentinel, None)
                    continue
                if message is not None and message[0] == "failed":
                    raise_startup_failure(r.index, "this machine", *message[1])
                raise DataParallelError(f"data-parallel replica {r.index} (pid {r.proc.pid}) "
                                        f"{describe_ended(r.proc)} while starting")
        infos = [r.info for r in self.replicas]
        log.info("data parallelism: %d local replicas, pids %s", self.size, [i.pid for i in infos])
        return infos

    # -- steady state -----------------------------------------------------------------
    def submit(self, index: int, batch: list[tuple]) -> None:
        r = self.replicas[index]
        if not r.lost:
            r.outbox.put((ADD, batch))

    def wait(self, timeout: float) -> list[tuple]:
        """Events since the last call, waiting up to ``timeout`` for the first one:
        ``("out", index, outputs, stats)`` and ``("lost", index, why[, suspects])`` (suspects: the requests
        it was running when it failed; absent or None when it could not say)."""
        live = [r for r in self.replicas if not r.lost]
        events: list[tuple] = [("lost", r.index, r.send_failed) for r in live if r.send_failed]
        handles: dict[Any, _Replica] = {r.results: r for r in live}
        handles.update({r.proc.sentinel: r for r in live})
        ready = multiprocessing.connection.wait(list(handles), 0 if events else timeout) if handles else []
        gone = {handles[h].index for h in ready if h is handles[h].proc.sentinel}
        for r in {handles[h] for h in ready}:
            self._drain(r, events, gone)
        self._check_silence(live, events, gone)
        for r in live:
            if r.index in gone and not any(e[0] == "lost" and e[1] == r.index for e in events):
                why = f"(pid {r.proc.pid}) {describe_ended(r.proc)}"
                text = r.error_text.rstrip()
                if text:
                    why += f"; its error:{chr(10) if chr(10) in text else ' '}{text}"
                events.append(("lost", r.index, why, r.suspects))
        for e in events:
            if e[0] == "lost":
                self.replicas[e[1]].lost = True
        return events

    def _check_silence(self, live: list[_Replica], events: list[tuple], gone: set[int]) -> None:
        """A replica the driver has heard nothing from for ``silence_s`` (not even the heartbeat its own
        thread sends) is lost, as a dead one is."""
        for r in live:
            if r.index in gone or time.monotonic() - r.heard <= self.silence_s:
                continue
            self._drain(r, events, gone)  # what it sent while the driver was busy elsewhere
            quiet = time.monotonic() - r.heard
            if r.index not in gone and quiet > self.silence_s and not any(
                    e[0] == "lost" and e[1] == r.index for e in events):
                # stopped from outside, not by what it ran: no request is blamed
                events.append(("lost", r.index, f"(pid {r.proc.pid}) {silence_text(quiet, self.silence_s)}", []))

    def _drain(self, r: _Replica, events: list[tuple], gone: set[int]) -> None:
        """Every complete message the replica sent (also after it died: the pipe keeps them)."""
        try:
            while r.results.poll():
                message = r.results.recv()
                r.heard = time.monotonic()
                if message[0] == "out":
                    events.append(("out", r.index, message[1], message[2]))
                elif message[0] == "died":
                    r.error_text, r.suspects = message[1], message[2]
        except (EOFError, OSError):
            gone.add(r.index)

    def kill(self, index: int) -> None:
        r = self.replicas[index]
        if r.proc.is_alive():
            r.proc.kill()

    def shutdown(self) -> None:
        self._finalizer()
