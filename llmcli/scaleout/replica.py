"""One data-parallel replica: an ``LLMEngine`` of its own, fed requests from an inbox, handing answers back.

The same loop runs in both backends: in a spawned process (``dp_local``), where
a reader thread fills the inbox from a pipe, and in a Ray actor (``dp_ray``),
where ``submit`` calls fill it. Only token ids cross: a request is
``(request_id, prompt_token_ids, SamplingParams)``; an answer is the
engine's ``RequestOutput`` plus a snapshot of its ``EngineStats``.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

HEARTBEAT_S = 0.5  # a busy replica reports its statistics at least this often, answers or not
SILENCE_ENV = "LLMCLI_DP_HEARTBEAT_S"
DEFAULT_SILENCE_S = 30.0

# inbox messages
ADD = "add"  # ("add", [(request_id, prompt_token_ids, params), ...])
STOP = "stop"  # ("stop",)


@dataclass
class ReplicaInfo:
    """What a replica reports once its engine has started."""

    index: int
    pid: int
    host: str
    device: str
    num_blocks: int
    memory_report: Any
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES as the replica sees it (set by the local pool, or by Ray)


def build_engine(engine_kwargs: dict[str, Any], threads: int | None) -> Any:
    """The replica's own engine, from the same knobs as the driver's (its own tokenizer for text and stops)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from llmcli.config import Config
    from llmcli.engine.llm_engine import LLMEngine

    return LLMEngine(Config(**engine_kwargs))


def silence_limit_s() -> float:
    """How long a replica may go without a word (a heartbeat, sent by a thread of its own whatever its engine
    computes) before it is reported lost: only a stopped (SIGSTOP) or frozen replica stays silent that long."""
    from llmcli.config import env_number

    return float(env_number(SILENCE_ENV, DEFAULT_SILENCE_S))


def silence_text(seconds: float, limit_s: float) -> str:
    return (f"stopped responding: no heartbeat for {seconds:.1f} s ({SILENCE_ENV}={limit_s:g}); it may have been "
            "stopped (SIGSTOP) or be frozen")


def describe(engine: Any, index: int) -> ReplicaInfo:
    runner = engine.model_runner
    return ReplicaInfo(index=index, pid=os.getpid(), host=socket.gethostname(), device=engine.config.device,
                       num_blocks=runner.num_blocks, memory_report=getattr(runner, "memory_report", None),
                       gpus=os.environ.get("CUDA_VISIBLE_DEVICES") if engine.config.device == "cuda" else None)


def startup_failure(exc: BaseException) -> tuple[str, str, str]:
    """(kind, message, traceback) of an exception raised while a replica started, for the driver to re-raise:
    the kind is the error's class name for a one-line start-up error (``engine/startup_errors.py``)."""
    from llmcli.engine.startup_errors import plain_error

    plain = plain_error(exc)
    return (plain[0] if plain is not None else "other"), str(exc), traceback.format_exc()


def running_ids(engine: Any) -> list[Any]:
    """The requests the engine was running (not only queued) when it failed: the ones that may have caused it."""
    try:
        return [seq.request_id for seq in engine.scheduler.running]
    except Exception:  # noqa: BLE001 - an engine in a broken state: nobody is blamed
        return []


def failure_text(exc: BaseException) -> str:
    """What a replica that failed while running tells the driver: the one line of a tensor-parallel rank's
    failure (its own report names the rank and the cause), else the traceback."""
    from llmcli.parallel.tp_group import TensorParallelError

    if isinstance(exc, TensorParallelError):
        return str(exc).splitlines()[0]
    return traceback.format_exc()


class ReplicaLoop:
    """Steps the engine while it has work; takes new requests between steps; emits answers as they finish.

    ``emit(outputs, stats)`` is called after every step that finished something,
    and every ``HEARTBEAT_S`` while the engine works without finishing anything
    (so the driver's progress display stays current).
    """

    def __init__(self, engine: Any, emit: Callable[[list[Any], Any], None]) -> None:
        self.engine = engine
        self.emit = emit
        self.inbox: queue.Queue = queue.Queue()

    def _take(self, block: bool) -> list[tuple]:
        messages = []
        try:
            messages.append(self.inbox.get(timeout=HEARTBEAT_S) if block else self.inbox.get_nowait())
            while True:
                messages.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return messages

    def run(self) -> None:
        """Until a STOP message arrives."""
        engine = self.engine
        last_report = time.monotonic()
        dirty = False  # stats changed since the last report
        while True:
            for message in self._take(block=not engine.has_unfinished()):
                if message[0] == STOP:
                    return
                for request_id, token_ids, params in message[1]:
                    # The driver checked the request against the smallest pool of all replicas, so the
                    # engine cannot reject it; if it does anyway, the replica fails and says why.
                    engine.add_request(token_ids, params, request_id=request_id)
                    dirty = True
            if not engine.has_unfinished():
                if dirty:
                    self.emit([], dataclasses.replace(engine.stats))
                    dirty, last_report = False, time.monotonic()
                continue
            finished = engine.step()
            dirty = True
            now = time.monotonic()
            if finished or now - last_report >= HEARTBEAT_S:
                self.emit(finished, dataclasses.replace(engine.stats))
                dirty, last_report = False, now
