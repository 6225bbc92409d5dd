"""Tensor parallelism: rank 0 in this process drives ranks 1..N-1 in spawned processes.

``start_tensor_parallel(config)`` returns a ``TensorParallelRunner``, which the
engine uses exactly like a ``ModelRunner`` (``launch``, ``run``, ``num_blocks``,
``memory_report``, ``shutdown``). Rank 0 is both the engine's runner and a
worker: every ``launch`` first broadcasts the step plan (``llmcli.engine.step_plan``,
without what only sampling reads), through the shared-memory control channel
(``llmcli.parallel.shm_channel``), then computes its own shard; the
collectives inside the model keep the ranks in step. Only rank 0 samples; it
broadcasts the sampled tokens to the other ranks on the device.

Backends: gloo on CPU, NCCL on CUDA with one GPU per rank (rank r uses
``cuda:r``). The rendezvous is a TCPStore that rank 0 opens on 127.0.0.1 with
an ephemeral port, and the channel's segment name carries the pid and a
random token, so two engines on one machine never collide.

The processes, channel, store and failure state live in a ``Group``
(``llmcli.parallel.tp_group``). Failure handling, in order of what usually happens:

* a watchdog thread waits on every worker's process sentinel; when one exits
  unexpectedly it records which rank and why (exit status or signal, plus the
  traceback the worker wrote into its error slot) and kills the other
  workers, so that rank 0's pending collective fails instead of waiting;
* rank 0's current or next call raises ``TensorParallelError`` with that
  message; the group is unusable afterwards and ``shutdown`` releases it;
* the same watchdog reads each worker's heartbeat (``llmcli.parallel.heartbeat``):
  a rank whose heartbeat stops for ``LLMCLI_TP_HEARTBEAT_S`` seconds (default
  30; a stopped or frozen process) is reported like a dead one, with what it
  was doing, and every worker is killed;
* if rank 0 stays inside its call for ``LLMCLI_TP_EXIT_GRACE_S`` seconds
  (default 3 with NCCL, 20 with gloo) after a worker died (an NCCL collective
  with a dead peer never returns; gloo's fails at once), the watchdog prints
  the message, kills every worker, removes the segment and ends the process
  with status 1.

``shutdown()`` (also run from ``atexit`` and when the runner is garbage
collected) frees rank 0's model and CUDA graphs, asks idle workers to leave,
kills the ones that do not, leaves the process group (an abort for NCCL, on a
thread that may take at most 10 s) and unlinks the segment. After a failure or
an interrupt the workers are killed first and the abort gets 3 s; if it is still
stuck, the process ends at interpreter exit with ``os._exit`` (status 130 after
Ctrl-C, else 1) instead of aborting in C++ clean-up. Workers ignore SIGINT, so
Ctrl-C only interrupts rank 0, whose exit then takes the workers down; a worker
whose parent disappears exits by itself.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - its atexit hook must be registered before ours (ours runs first)
import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from llmcli.config import Config, ConfigError
from llmcli.engine.cpu_threads import cpu_threads
from llmcli.engine.step_plan import StepPlan
from llmcli.parallel.heartbeat import DEFAULT_HEARTBEAT_S, HEARTBEAT_ENV
from llmcli.parallel.shm_channel import ControlChannel
from llmcli.parallel.tp_group import STORE_HOST, Group, TensorParallelError, env_seconds
from llmcli.parallel.worker import READY_KEY, WorkerArgs, gloo_on_loopback, worker_main

log = logging.getLogger("llmcli")


def check_tensor_parallel_shapes(hf_config: Any, tp: int) -> None:
    """Every split dimension must divide by ``tp``; KV heads are split, never replicated."""
    dims = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    # each rank holds a slice of every expert (gpt-oss's experts are intermediate_size wide, checked above)
    if getattr(hf_config, "num_experts", 0) and getattr(hf_config, "moe_intermediate_size", None):
        dims["moe_intermediate_size"] = hf_config.moe_intermediate_size
    per_layer = getattr(hf_config, "per_layer_config", None)  # layers of their own KV heads (Gemma 4's global)
    if per_layer is not None:
        others = {per_layer[i].num_key_value_heads for i in range(hf_config.num_hidden_layers)}
        others.discard(dims["num_key_value_heads"])
        if others:
            dims["num_global_key_value_heads"] = min(others)
    bad = [f"{name}={value}" for name, value in dims.items() if value % tp]
    if bad:
        heads, kv = dims["num_attention_heads"], dims["num_key_value_heads"]
        fits = [n for n in range(1, heads + 1) if all(v % n == 0 for v in dims.values())]
        raise ConfigError(
            f"Config.tensor_parallel_size={tp}: this model's {', '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {tp}. llmcli splits the attention heads "
            f"({heads}), the key/value heads ({kv}; replicating KV heads over ranks is not supported) and the MLP "
            f"(every expert's, for a mixture of experts) evenly over the ranks; tensor_parallel_size may be one of {', '.join(map(str, fits))}")


def start_tensor_parallel(config: Config) -> "TensorParallelRunner":
    """Spawn ranks 1..N-1, join the process group as rank 0 and build every rank's model shard."""
    return TensorParallelRunner(config)


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
        timeout_s = env_seconds("LLMCLI_TP_TIMEOUT_S", 600.0)
        # gloo fails a collective as soon as a peer's socket closes; NCCL waits forever, so do not wait long
        grace = env_seconds("LLMCLI_TP_EXIT_GRACE_S", 3.0 if self.backend == "nccl" else 20.0)
        heartbeat_s = env_seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)
        self._group = group = Group(world, grace, heartbeat_s)
        self._runner: Any = None
        self._finalizer = weakref.finalize(self, group.teardown)
        self._finalizer.atexit = False  # the explicit atexit hook below runs before multiprocessing's own
        atexit.register(group.at_exit)
        try:
            ctx = multiprocessing.get_context("spawn")
            group.channel = ControlChannel.create(ctx, world)
            timeout = datetime.timedelta(seconds=timeout_s)
            group.store = dist.TCPStore(STORE_HOST, 0, world, is_master=True, timeout=timeout,
                                        wait_for_workers=False)
            threads = cpu_threads(config.hf_config.hidden_size, world)
            for rank in range(1, world):
                args = WorkerArgs(rank=rank, world_size=world, backend=self.backend, store_host=STORE_HOST,
                                  store_port=group.store.port, timeout_s=timeout_s, threads=threads,
                                  parent_pid=os.getpid(), channel=group.channel.spec, heartbeat_s=heartbeat_s)
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

    def launch(self, plan: StepPlan, before_sample: Any = None) -> "GroupStep":
        """Broadcast the step to every worker and enqueue rank 0's shard; like ``ModelRunner.launch``.

        The workers' steps never wait for the host: the tokens each step samples reach them on the
        device (``ModelRunner._share_tokens``), so the engine overlaps its host work with the device at
        any tensor-parallel size.
        """
        group = self._group
        with group.call("launch"):
            # the control plane's cost counts as input preparation in the engine's step timer
            with self._runner.timer.phase("prepare"):
                group.channel.post("run", (plan.for_workers(),), group.check_alive)
            # token masks (structured outputs) are built here on rank 0, where sampling happens
            return GroupStep(self._runner.launch(plan, before_sample), group)

    def run(self, plan: StepPlan, before_sample: Any = None) -> list[int]:
        """Compute one step on every rank and return rank 0's sampled tokens."""
        return self.launch(plan, before_sample).token_ids()

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


class GroupStep:
    """A launched tensor-parallel step: reading its tokens back is a group call, so that a worker dying
    while rank 0 waits for the device is reported (or ends the process) like any other failure."""

    def __init__(self, step: Any, group: Group) -> None:
        self.step, self.group = step, group

    def token_ids(self) -> list[int]:
        with self.group.call("wait for the step's tokens"):
            return self.step.token_ids()

    def logprobs(self) -> Any:
        """Rank 0's logprobs of the step (read after ``token_ids``, so nothing more to wait for)."""
        return self.step.logprobs()
