"""Data-parallel replicas as Ray actors, on the GPUs (or CPUs) of a Ray cluster.

Every replica gets a placement group of its own with one bundle that holds
everything the replica uses: ``{"GPU": tp, "CPU": 1}`` on CUDA, ``{"CPU": tp}``
on CPU, packed on one node (STRICT_PACK). One bundle rather than tp bundles of
one GPU: the replica's tensor-parallel ranks are processes it spawns itself,
not Ray actors, so the actor must hold all tp GPUs for Ray to make them
visible to it (``CUDA_VISIBLE_DEVICES``), and they must be on one node.

The actor (``ReplicaActor``, threaded) builds its own engine from the same
engine knobs as the driver (the model path or hub id must resolve on its node)
and runs ``ReplicaLoop`` in a thread of its own. ``submit(batch)`` puts requests
in its inbox and returns at once; ``poll(timeout)`` returns what finished since
the last poll (waiting up to ``timeout`` for something). The driver keeps one
``poll`` in flight per actor and waits on all of them with ``ray.wait``; a
``RayActorError`` from a poll means that replica is lost, and so does a poll
that has not come back within ``LLMCLI_DP_HEARTBEAT_S`` (a stopped or frozen
actor: polls are served by a thread of their own).

Ray itself: if Ray is not initialized in this process, the pool calls
``ray.init`` (with the address given, or a new local cluster without one) and
``ray.shutdown`` at the end, which for an address only disconnects. A Ray that
the caller initialized is left as it was.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import traceback
import uuid
from typing import Any

from llmcli.scaleout.errors import DataParallelError, raise_startup_failure
from llmcli.scaleout.replica import (ADD, STOP, ReplicaInfo, ReplicaLoop, build_engine, describe, running_ids,
                                     silence_limit_s, silence_text, startup_failure)

log = logging.getLogger("llmcli")

POLL_S = 0.5  # how long an actor's poll waits for something to report
STOP_WAIT_S = 10.0
INSTALL_HINT = "pip install 'llmcli[ray]'"


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


# -- placement ---------------------------------------------------------------------------
def replica_bundle(use_gpu: bool, tp: int) -> dict[str, float]:
    """The one bundle of a replica's placement group: all it uses, on one node."""
    return {"GPU": float(tp), "CPU": 1.0} if use_gpu else {"CPU": float(tp)}


def actor_resources(use_gpu: bool, tp: int) -> dict[str, float]:
    """What the replica actor asks for inside its bundle: all of it, so Ray makes its tp GPUs visible to it."""
    bundle = replica_bundle(use_gpu, tp)
    return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0)}


def check_resources(cluster: dict[str, float], size: int, use_gpu: bool, tp: int) -> None:
    """Raise ConfigError, before anything is placed, when the cluster's totals cannot hold ``size`` bundles."""
    from llmcli.config import ConfigError

    bundle = replica_bundle(use_gpu, tp)
    for name, amount in bundle.items():
        need = amount * size
        have = cluster.get(name, 0.0)
        if have < need:
            what = "GPUs" if name == "GPU" else "CPUs"
            raise ConfigError(f"--data-parallel-size {size} with tensor_parallel_size {tp} needs "
                              f"{need:g} {what} on the Ray cluster ({size} x {bundle}), which has {have:g}")


class ReplicaActor:
    """The body of one replica actor (made a Ray actor class by ``RayReplicaPool``)."""

    def __init__(self, index: int, engine_kwargs: dict[str, Any], threads: int | None) -> None:
        self.index = index
        self.engine_kwargs = engine_kwargs
        self.threads = threads
        self.engine: Any = None
        self.loop: ReplicaLoop | None = None
        self.thread: threading.Thread | None = None
        self.outbox: queue.Queue = queue.Queue()

    def start(self) -> tuple[str, Any]:
        """Build the engine and start stepping it: ("ready", ReplicaInfo) or ("failed", (kind, message, traceback))."""
        try:
            self.engine = build_engine(self.engine_kwargs, self.threads)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver
            return "failed", startup_failure(exc)
        self.loop = ReplicaLoop(self.engine, lambda outs, stats: self.outbox.put(("out", outs, stats)))
        self.thread = threading.Thread(target=self._run, daemon=True, name="llmcli-dp-replica")
        self.thread.start()
        info = describe(self.engine, self.index)
        with contextlib.suppress(Exception):
            import ray

            info.host = ray.util.get_node_ip_address()
        return "ready", info

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException:  # noqa: BLE001 - the driver treats this replica as lost and says why
            self.outbox.put(("died", traceback.format_exc(), running_ids(self.engine)))

    def submit(self, batch: list[tuple]) -> None:
        self.loop.inbox.put((ADD, batch))

    def poll(self, timeout: float) -> tuple[list, Any, str | None, list]:
        """(outputs, latest stats or None, traceback if the loop died, what it was running then) since the last
        poll."""
        outputs: list = []
        stats = None
        error = None
        suspects: list = []
        items = []
        try:
            items.append(self.outbox.get(timeout=timeout))
            while True:
                items.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            if item[0] == "out":
                outputs.extend(item[1])
                stats = item[2]
            else:
                error, suspects = item[1], item[2]
        return outputs, stats, error, suspects

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.inbox.put((STOP,))
        if self.thread is not None:
            self.thread.join(STOP_WAIT_S)
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def pid(self) -> int:
        return os.getpid()


class RayReplicaPool:
    """``size`` replica actors, one placement group each."""

    backend = "ray"

    def __init__(self, engine_kwargs: dict[str, Any], size: int, *, use_gpu: bool | None, tensor_parallel_size: int,
                 address: str | None) -> None:
        self.engine_kwargs = engine_kwargs
        self.size = size
        self.use_gpu = use_gpu
        self.tp = tensor_parallel_size
        self.address = address
        self.run_id = uuid.uuid4().hex[:8]
        self.actors: list[Any] = []
        self.groups: list[Any] = []
        self.polls: dict[int, Any] = {}  # replica -> its poll in flight
        self.polled_at: dict[int, float] = {}  # replica -> when that poll was sent
        self.silence_s = silence_limit_s()
        self.submits: dict[int, list[Any]] = {}  # replica -> submit refs not yet seen done
        self.lost: set[int] = set()
        self.owns_ray = False
        self._reaper: Any = None  # the local cluster's watcher (ray_reaper.py), when this driver started one
        self.torn_down = False
        self._ray: Any = None

    @property
    def bundle(self) -> dict[str, float]:
        return replica_bundle(bool(self.use_gpu), self.tp)

    def actor_name(self, index: int) -> str:
        return f"llmcli-dp-{self.run_id}-replica{index}"

    def _connect(self) -> Any:
        try:
            import ray
        except ImportError:
            raise DataParallelError(f"the Ray backend needs Ray: {INSTALL_HINT}") from None
        self._ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
            if self.address:
                kwargs["address"] = self.address
            else:
                kwargs["include_dashboard"] = False
            try:
                ray.init(**kwargs)
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds (ConnectionError, ValueError, ...)
                where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
                raise DataParallelError(f"could not connect to {where}: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
            self.owns_ray = True
            if not self.address:
                self._reaper = _start_reaper(ray)
        return ray

    def start(self, timeout_s: float) -> list[ReplicaInfo]:
        atexit.register(self.shutdown)
        try:
            return self._start(timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _check_resources(self, ray: Any) -> None:
        check_resources(ray.cluster_resources(), self.size, bool(self.use_gpu), self.tp)

    def _start(self, timeout_s: float) -> list[ReplicaInfo]:
        ray = self._connect()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.use_gpu is None:  # device "auto": GPUs if the cluster has any
            self.use_gpu = ray.cluster_resources().get("GPU", 0.0) > 0
        self.engine_kwargs = dict(self.engine_kwargs, device="cuda" if self.use_gpu else "cpu")
        self._check_resources(ray)
        deadline = time.monotonic() + timeout_s
        for index in range(self.size):
            self.groups.append(placement_group([self.bundle], strategy="STRICT_PACK",
                                               name=f"llmcli-dp-{self.run_id}-{index}"))
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=self.size,
                            timeout=max(1.0, deadline - time.monotonic()))
        if len(ready) < self.size:
            raise DataParallelError(f"the Ray cluster could not place {self.size - len(ready)} of {self.size} "
                                    f"replicas ({self.bundle} on one node each) within {timeout_s:.0f} s; "
                                    f"it has {ray.available_resources()} free")
        actor_class = ray.remote(ReplicaActor)
        threads = None if self.use_gpu else self.tp
        for index, group in enumerate(self.groups):
            options: dict[str, Any] = dict(
                name=self.actor_name(index), max_concurrency=4, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=0),
                **actor_resources(bool(self.use_gpu), self.tp))
            self.actors.append(actor_class.options(**options).remote(index, self.engine_kwargs, threads))
        starts = {actor.start.remote(): index for index, actor in enumerate(self.actors)}
        infos: dict[int, ReplicaInfo] = {}
        pending = list(starts)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataParallelError(f"data-parallel replica(s) {sorted(starts[p] for p in pending)} did not "
                                        f"start within {timeout_s:.0f} s (LLMCLI_DP_START_TIMEOUT_S)")
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
            for ref in done:
                index = starts[ref]
                try:
                    status, payload = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise DataParallelError(f"data-parallel replica {index} failed while starting: {exc}") from None
                if status == "failed":
                    raise_startup_failure(index, "its Ray node", *payload)
                infos[index] = payload
        for index in range(self.size):
            self._poll(index)
            self.submits[index] = []
        log.info("data parallelism: %d Ray replicas on %s", self.size, sorted({i.host for i in infos.values()}))
        return [infos[i] for i in range(self.size)]

    # -- steady state -----------------------------------------------------------------
    def submit(self, index: int, batch: list[tuple]) -> None:
        if index in self.lost:
            return
        refs = self.submits[index]
        refs.append(self.actors[index].submit.remote(batch))
        if len(refs) > 32:  # consume finished submits, so a failed one is never reported as unhandled
            done, rest = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            self._consume(done)
            self.submits[index] = rest

    def _consume(self, refs: list[Any]) -> None:
        for ref in refs:
            with contextlib.suppress(Exception):
                self._ray.get(ref, timeout=0)

    def wait(self, timeout: float) -> list[tuple]:
        ray = self._ray
        by_ref = {ref: index for index, ref in self.polls.items() if index not in self.lost}
        if not by_ref:
            return []
        refs = list(by_ref)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        events: list[tuple] = []
        for ref in ready:
            index = by_ref[ref]
            try:
                outputs, stats, error, suspects = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self._lose(index, f"(Ray actor {self.actor_name(index)}) was lost: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}", events)
                continue
            if outputs or stats is not None:
                events.append(("out", index, outputs, stats))
            if error is not None:
                self._lose(index, f"(Ray actor {self.actor_name(index)}) failed; its error:\n{error.rstrip()}", events,
                           suspects)
                continue
            self._poll(index)
        # A poll returns within POLL_S from a thread of the actor's own, whatever its engine computes: one that
        # has not come back in silence_s means a stopped or frozen actor (or its node), lost as a dead one.
        now = time.monotonic()
        for index in list(self.polls):
            quiet = now - self.polled_at[index] - POLL_S
            if index not in self.lost and quiet > self.silence_s:
                self._lose(index, f"(Ray actor {self.actor_name(index)}) {silence_text(quiet, self.silence_s)}",
                           events, [])
        return events

    def _poll(self, index: int) -> None:
        self.polls[index] = self.actors[index].poll.remote(POLL_S)
        self.polled_at[index] = time.monotonic()

    def _lose(self, index: int, why: str, events: list[tuple], suspects: list | None = None) -> None:
        self.lost.add(index)
        self._consume(self.submits.pop(index, []))
        self.polls.pop(index, None)
        events.append(("lost", index, why, suspects))
        self.kill(index)

    def kill(self, index: int) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self.actors[index], no_restart=True)

    def shutdown(self) -> None:
        if self.torn_down:
            return
        self.torn_down = True
        atexit.unregister(self.shutdown)
        ray = self._ray
        if ray is None or not ray.is_initialized():
            return
        live = [i for i in range(len(self.actors)) if i not in self.lost]
        stops = [self.actors[i].stop.remote() for i in live]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S)
        self._consume(stops)
        for refs in self.submits.values():
            self._consume(refs)
        self._consume(list(self.polls.values()))
        for i in range(len(self.actors)):
            self.kill(i)
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if self.owns_ray:
            ray.shutdown()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:  # its pipe closing is its signal: Ray is down, sweep what is left
            with contextlib.suppress(Exception):
                reaper.stdin.close()
                reaper.wait(timeout=5)


def _start_reaper(ray: Any) -> Any:
    """The watcher that takes the local cluster's agents down with this driver (``ray_reaper.py``); None if the
    raylet cannot be found (a Ray whose internals moved: its agents then exit on their own, later)."""
    import subprocess
    import sys

    try:
        raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    script = os.path.join(os.path.dirname(__file__), "ray_reaper.py")
    return subprocess.Popen([sys.executable, "-S", script, str(raylet)], stdin=subprocess.PIPE,
                            start_new_session=True, close_fds=True)
