"""Tensor-parallel ranks 1..N-1: spawned processes that only compute.

Each worker joins the process group, builds its shard of the model with the
same ``ModelRunner`` as rank 0, then loops: wait for a command in the shared
memory channel (a step plan: ``llmcli.engine.step_plan``), run it, repeat. It
never samples and never sees the tokenizer, the scheduler or a ``Sequence``.

A worker ignores SIGINT (Ctrl-C in a terminal reaches the whole process
group; rank 0 decides how to stop and tears the workers down). It exits on
its own when its parent disappears. Any exception is written, as traceback
text, into its error slot of the channel before the process exits with
status 1, so rank 0 can report it.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

from llmcli.parallel.heartbeat import DEFAULT_HEARTBEAT_S, Heartbeat
from llmcli.parallel.shm_channel import ChannelSpec, ControlChannel

PARENT_POLL_S = 0.5
READY_KEY = "llmcli_tp/ready"


def loopback_interface() -> str | None:
    """The loopback interface's name where gloo should bind (every rank is on this host), if known."""
    for name in ("lo", "lo0"):
        if os.path.exists(f"/sys/class/net/{name}"):
            return name
    return None


@contextlib.contextmanager
def gloo_on_loopback(backend: str) -> Iterator[None]:
    """Let gloo bind to the loopback interface instead of whatever the host name resolves to.

    Only for the duration of joining the group, and only when the user has not chosen an interface.
    """
    name = loopback_interface()
    if backend != "gloo" or name is None or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


PG_CLOSE_TIMEOUT_S = 10.0


def close_process_group(timeout_s: float = PG_CLOSE_TIMEOUT_S) -> bool:
    """Leave this process's group without waiting on the other ranks; False if that did not end in time.

    NCCL's graceful destroy finalizes each communicator, which may wait for the other ranks and for
    work recorded in CUDA graphs; on two H200s it held rank 0 for over a minute at the end of a TP=2
    run (benchmarks/RESULTS.md, run 5). An abort (ncclCommAbort) needs no peer, and nothing is in
    flight at shutdown. The call runs on a daemon thread, so no library call can keep the process
    from ending.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return True

    def close() -> None:
        with contextlib.suppress(Exception):
            if dist.get_backend() == "nccl":
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            else:
                dist.destroy_process_group()

    thread = threading.Thread(target=close, daemon=True, name="llmcli-tp-close")
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


@dataclass
class WorkerArgs:
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    store_host: str
    store_port: int
    timeout_s: float
    threads: int
    parent_pid: int
    channel: ChannelSpec
    heartbeat_s: float = DEFAULT_HEARTBEAT_S


def _watch_parent(parent_pid: int, channel: ControlChannel | None) -> None:
    """Daemon thread: leave at once (even from inside a collective) when rank 0's process is gone."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            if channel is not None:
                channel.unlink()  # nobody else is left to remove the segment's name
            os._exit(3)


class WorkerLoop:
    """Receives calls from rank 0 and runs them on this rank's ModelRunner."""

    def __init__(self, args: WorkerArgs, channel: ControlChannel, runner: Any, heartbeat: Heartbeat) -> None:
        self.args, self.channel, self.runner, self.heartbeat = args, channel, runner, heartbeat

    def serve(self) -> None:
        rank = self.args.rank
        while True:
            self.heartbeat.say("waiting for rank 0's next call")
            while not self.channel.wait_command(rank, 1.0):
                pass  # the parent watchdog thread handles an orphaned worker
            number, method, args = self.channel.take_command(rank)
            if method == "shutdown":
                self.heartbeat.say("shutting down")
                return
            kind = ("a prefill step" if args[0].is_prefill else "a decode step") if method == "run" else f"'{method}'"
            self.heartbeat.say(f"running {kind} (control call {number})")
            handler = getattr(self, f"do_{method}", None)
            if handler is None:
                raise RuntimeError(f"rank {rank} got an unknown control-plane call {method!r}")
            handler(*args)

    # -- calls --------------------------------------------------------------------
    def do_run(self, plan: Any) -> None:
        self.runner.run(plan)

    def do_ping(self) -> None:
        pass


def worker_main(config: Any, args: WorkerArgs) -> None:
    """Entry point of a spawned rank (``multiprocessing`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints where a rank is stuck
    channel: ControlChannel | None = None
    try:
        channel = ControlChannel.attach(args.channel)
        heartbeat = Heartbeat(channel, args.rank, args.heartbeat_s).start()
        threading.Thread(target=_watch_parent, args=(args.parent_pid, channel), daemon=True,
                         name="llmcli-tp-parent-watch").start()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(args.threads)
        if args.backend == "nccl":
            torch.cuda.set_device(args.rank)
        store = dist.TCPStore(args.store_host, args.store_port, args.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=args.timeout_s))
        heartbeat.say("joining the process group")
        store.set(f"{READY_KEY}/{args.rank}", "1")  # rank 0 joins the group only when every worker got here
        kwargs = {"device_id": torch.device("cuda", args.rank)} if args.backend == "nccl" else {}
        with gloo_on_loopback(args.backend):
            dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world_size,
                                    timeout=datetime.timedelta(seconds=args.timeout_s), **kwargs)
        from llmcli.engine.model_runner import ModelRunner

        heartbeat.say("loading its model shard")
        runner = ModelRunner(config)
        WorkerLoop(args, channel, runner, heartbeat).serve()
        runner.shutdown()  # CUDA graphs and memory go before the communicator they use
    except BaseException as exc:  # noqa: BLE001 - everything goes back to rank 0, then the process ends
        from llmcli.engine.startup_errors import tag_line

        text = traceback.format_exc() + tag_line(exc)
        if channel is not None:
            try:
                channel.write_error(args.rank, text)
            except Exception:  # noqa: BLE001
                pass
        if channel is None or os.getppid() != args.parent_pid:  # nobody will read the error slot
            sys.stderr.write(f"llmcli tensor-parallel rank {args.rank} failed:\n{text}")
            sys.stderr.flush()
            if channel is not None:
                channel.unlink()
        os._exit(1)
    # clean shutdown asked by rank 0
    try:
        close_process_group()
    finally:
        channel.close()
