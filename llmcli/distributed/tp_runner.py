"""Tensor parallelism: rank 0 in this process drives ranks 1..N-1 in spawned processes.

``start_tensor_parallel(config)`` returns a ``TensorParallelRunner``, which the
engine uses exactly like a ``ModelRunner`` (``run``, ``num_blocks``,
``memory_report``, ``shutdown``). Rank 0 is both the engine's runner and a
worker: every ``run`` first broadcasts the step, in compact form
(``llmcli.distributed.compact``), through the shared-memory control channel
(``llmcli.distributed.shm_channel``), then computes its own shard; the
collectives inside the model keep the ranks in step. Only rank 0 samples.

Backends: gloo on CPU, NCCL on CUDA with one GPU per rank (rank r uses
``cuda:r``). The rendezvous is a TCPStore that rank 0 opens on 127.0.0.1 with
an ephemeral port, and the channel's segment name carries the pid and a
random token, so two engines on one machine never collide.

Failure handling, in order of what usually happens:

* a watchdog thread waits on every worker's process sentinel; when one exits
  unexpectedly it records which rank and why (exit status or signal, plus the
  traceback the worker wrote into its error slot) and kills the other
  workers, so that rank 0's pending collective fails instead of waiting;
* rank 0's current or next call raises ``TensorParallelError`` with that
  message; the group is unusable afterwards and ``shutdown`` releases it;
* if rank 0 stays inside its call for ``LLMCLI_TP_EXIT_GRACE_S`` seconds
  (default 20) after a worker died (NCCL can block where gloo fails
  fast), the watchdog prints the message, kills every worker, removes the
  segment and ends the process with status 1.

``shutdown()`` (also run from ``atexit`` and when the runner is garbage
collected) asks idle workers to leave, kills the ones that do not, destroys
the process group and unlinks the segment. Workers ignore SIGINT, so Ctrl-C
only interrupts rank 0, whose exit then takes the workers down; a worker whose
parent disappears exits by itself.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401 - its atexit hook must be registered before ours (ours runs first)
import os
import threading
import time
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist

from llmcli.config import Config, ConfigError
from llmcli.distributed.compact import pack_step
from llmcli.distributed.exits import describe_exit
from llmcli.distributed.shm_channel import ControlChannel, PayloadTooLarge
from llmcli.distributed.worker import (PG_CLOSE_TIMEOUT_S, READY_KEY, WorkerArgs, close_process_group,
                                       gloo_on_loopback, worker_main)

log = logging.getLogger("llmcli")

STORE_HOST = "127.0.0.1"
SHUTDOWN_WAIT_S = 5.0
FAILURE_SETTLE_S = 2.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the message names the rank and why. The group cannot be used again."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def check_tensor_parallel_shapes(hf_config: Any, tp: int) -> None:
    """Every split dimension must divide by ``tp``; KV heads are split, never replicated."""
    dims = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in dims.items() if value % tp]
    if bad:
        heads, kv = dims["num_attention_heads"], dims["num_key_value_heads"]
        fits = [n for n in range(1, heads + 1) if all(v % n == 0 for v in dims.values())]
        raise ConfigError(
            f"Config.tensor_parallel_size={tp}: this model's {', '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {tp}. llmcli splits the attention heads "
            f"({heads}), the key/value heads ({kv}; replicating KV heads over ranks is not supported) and the MLP "
            f"evenly over the ranks; tensor_parallel_size may be one of {', '.join(map(str, fits))}")


def start_tensor_parallel(config: Config) -> "TensorParallelRunner":
    """Spawn ranks 1..N-1, join the process group as rank 0 and build every rank's model shard."""
    return TensorParallelRunner(config)


class _Group:
    """The processes, channel and rendezvous of one engine, and their failure state.

    Holds no reference to the runner, so the runner can be garbage collected
    and its finalizer (``teardown``) still has everything it needs.
    """

    def __init__(self, world: int, grace_s: float) -> None:
        self.world = world
        self.grace_s = grace_s
        self.procs: dict[int, Any] = {}  # rank -> multiprocessing.Process
        self.channel: ControlChannel | None = None
        self.store: Any = None
        self.pg_owned = False
        self.lock = threading.Lock()
        self.failure: str | None = None  # first worker death, as reported to the user
        self.failed_rank: int | None = None
        self.broken: str | None = None  # rank 0 itself failed mid-call: workers may be stuck in a collective
        self.closing = False
        self.torn_down = False
        self.in_call: str | None = None
        self.call_number = 0
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
            proc.join(0.5)  # let the exit status settle
            message = f"tensor-parallel rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}"
            try:
                error = self.channel.read_error(rank).strip() if self.channel is not None else ""
            except (ValueError, OSError):  # the segment is already closed
                error = ""
            if error:
                message += f"; its error:\n{error}"
            elif proc.exitcode is not None and proc.exitcode > 0:
                message += (" without reporting an error from llmcli's worker code (see its output above). "
                            "Workers are started with multiprocessing's 'spawn' method, which imports your main "
                            "script again: a script that creates the LLM at import time must do it under "
                            "`if __name__ == \"__main__\":`")
            self.failed_rank, self.failure = rank, message
        log.error("llmcli: %s", message)
        for other, p in self.procs.items():
            if other != rank and p.is_alive():
                p.kill()  # a collective with a dead member fails fast only once every peer is gone

    def poll_workers(self) -> None:
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                self.worker_exited(rank)

    def check(self) -> None:
        """Raise if the group cannot take another call."""
        if self.failure is not None:
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
            ready = multiprocessing.connection.wait(list(pending) + [self._wake_r])
            if self.closing or self._wake_r in ready:
                return
            for sentinel in ready:
                rank = pending.pop(sentinel, None)
                if rank is not None:
                    self.worker_exited(rank)
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
        self.in_call = what
        try:
            self.check()
            yield
        except (TensorParallelError, PayloadTooLarge):
            raise
        except KeyboardInterrupt:
            self.broken = f"interrupted during {what}"
            raise
        except BaseException as exc:
            failure = self.wait_for_failure(FAILURE_SETTLE_S)
            if failure is not None:
                raise TensorParallelError(f"{failure}\n(rank 0 saw: {type(exc).__name__}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
            self.broken = f"rank 0 raised {type(exc).__name__} during {what}"
            raise
        finally:
            self.in_call = None

    # -- teardown ---------------------------------------------------------------
    def teardown(self) -> None:
        """Release every rank, the process group, the store and the segment (idempotent)."""
        with self.lock:
            if self.torn_down:
                return
            self.torn_down = True
        atexit.unregister(self.teardown)
        self.poll_workers()
        clean = (self.failure is None and self.broken is None and self.in_call is None and self.procs
                 and all(p.is_alive() for p in self.procs.values()))
        self.closing = True
        if clean and self.channel is not None:
            deadline = time.monotonic() + SHUTDOWN_WAIT_S

            def give_up() -> None:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs.values()):
                    raise TimeoutError

            try:
                self.channel.post("shutdown", (), give_up)
            except (TimeoutError, OSError, ValueError):
                clean = False
        if self.pg_owned and not close_process_group():
            log.warning("the tensor-parallel process group did not close within %.0f s; leaving it behind",
                        PG_CLOSE_TIMEOUT_S)
        self.pg_owned = False
        deadline = time.monotonic() + (SHUTDOWN_WAIT_S if clean else 0.0)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(SHUTDOWN_WAIT_S)
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
            # With "spawn", each event is made of named POSIX semaphores (/dev/shm/sem.mp-*) that are unlinked
            # when the objects are collected: drop the only references (the worker args share these lists).
            self.channel.spec.commands.clear()
            self.channel.spec.acks.clear()
        self.store = None


class TensorParallelRunner:
    """Rank 0's ``ModelRunner`` plus the control plane that mirrors each call on the other ranks."""

    def __init__(self, config: Config) -> None:
        world = config.tensor_parallel_size
        check_tensor_parallel_shapes(config.hf_config, world)
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process (another "
                               "tensor-parallel engine?); shut it down before starting a new one")
        self.config = config
        self.world_size = world
        self.backend = "nccl" if config.device == "cuda" else "gloo"
        timeout_s = _env_seconds("LLMCLI_TP_TIMEOUT_S", 600.0)
        self._group = group = _Group(world, _env_seconds("LLMCLI_TP_EXIT_GRACE_S", 20.0))
        self._runner: Any = None
        self._finalizer = weakref.finalize(self, group.teardown)
        self._finalizer.atexit = False  # the explicit atexit hook below runs before multiprocessing's own
        atexit.register(group.teardown)
        try:
            ctx = multiprocessing.get_context("spawn")
            group.channel = ControlChannel.create(ctx, world)
            timeout = datetime.timedelta(seconds=timeout_s)
            group.store = dist.TCPStore(STORE_HOST, 0, world, is_master=True, timeout=timeout,
                                        wait_for_workers=False)
            threads = max(1, torch.get_num_threads() // world)
            for rank in range(1, world):
                args = WorkerArgs(rank=rank, world_size=world, backend=self.backend, store_host=STORE_HOST,
                                  store_port=group.store.port, timeout_s=timeout_s, threads=threads,
                                  parent_pid=os.getpid(), channel=group.channel.spec)
                proc = ctx.Process(target=worker_main, args=(config, args), name=f"llmcli-tp-rank{rank}")
                proc.start()
                group.procs[rank] = proc
            group.start_watchdog()
            with group.call("start-up"):
                self._wait_for_workers(timeout_s)
                kwargs: dict[str, Any] = {}
                if self.backend == "nccl":
                    torch.cuda.set_device(0)
                    kwargs["device_id"] = torch.device("cuda", 0)
                with gloo_on_loopback(self.backend):
                    dist.init_process_group(self.backend, store=group.store, rank=0, world_size=world,
                                            timeout=timeout, **kwargs)
                group.pg_owned = True
                from llmcli.engine.model_runner import ModelRunner

                self._runner = ModelRunner(config)
        except BaseException:
            group.teardown()
            raise
        log.info("tensor parallelism: %d ranks (%s), worker pids %s, control segment /dev/shm/%s",
                 world, self.backend, self.worker_pids, group.channel.name)

    def _wait_for_workers(self, timeout_s: float) -> None:
        """Until every worker is about to join the group (so a worker that fails to start is reported at once
        instead of leaving rank 0 waiting in the rendezvous)."""
        group = self._group
        keys = [f"{READY_KEY}/{rank}" for rank in group.procs]
        deadline = time.monotonic() + timeout_s
        while not group.store.check(keys):
            group.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel workers did not start within {timeout_s:.0f} s "
                                          "(LLMCLI_TP_TIMEOUT_S)")
            time.sleep(0.01)

    # -- what the engine uses ---------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._runner.num_blocks

    @property
    def memory_report(self) -> Any:
        return self._runner.memory_report

    def run(self, seqs: list, is_prefill: bool) -> list[int]:
        """Broadcast the step to every worker, compute rank 0's shard, return rank 0's sampled tokens."""
        group = self._group
        timer = getattr(self._runner, "timer", None)
        with group.call("run"):
            # the control plane's cost counts as input preparation in the engine's step timer
            with timer.phase("prepare") if timer is not None else contextlib.nullcontext():
                group.channel.post("run", (is_prefill, pack_step(seqs, is_prefill)), group.check_alive)
            return self._runner.run(seqs, is_prefill)

    def shutdown(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                runner.shutdown()  # CUDA graphs and memory go before the communicator they use
        self._finalizer()

    # -- introspection --------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self._group.procs.items())]

    @property
    def shm_name(self) -> str | None:
        return self._group.channel.name if self._group.channel is not None else None

    def broadcast(self, method: str, *args: Any) -> None:
        """Send a bare control-plane call to every worker (used by tests: ``ping``)."""
        group = self._group
        with group.call(method):
            group.channel.post(method, args, group.check_alive)

    def __getattr__(self, name: str) -> Any:
        # Plain data of rank 0's runner (device, model, ...) reads through; methods do not, because a
        # method that runs collectives would need the other ranks to run it too.
        if name.startswith("_") or self.__dict__.get("_runner") is None:
            raise AttributeError(name)
        value = getattr(self._runner, name)
        if callable(value) and not isinstance(value, torch.nn.Module):
            raise AttributeError(f"{name!r} of rank 0's ModelRunner is not mirrored on the other ranks; "
                                 "add it to TensorParallelRunner")
        return value
