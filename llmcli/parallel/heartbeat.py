"""Telling a silent tensor-parallel rank from a busy one: worker heartbeats, and rank 0's check of them.

A thread in each worker bumps a counter in the control segment several times
per limit, with a few words on what the worker is doing; the worker's main
thread also beats at once whenever that changes, so what rank 0 reads is
never a phase behind. The thread runs whatever the worker computes (torch
releases the GIL), so only a stopped (SIGSTOP) or frozen process goes
silent. Rank 0's watchdog calls ``silent`` every tick; time is measured on
rank 0's clock from the last change it saw.
A rank is judged only after its first beat: a worker that never starts is
the start-up timeout's business (``LLMCLI_TP_TIMEOUT_S``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

HEARTBEAT_ENV = "LLMCLI_TP_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0


def beat_interval(limit_s: float) -> float:
    return min(1.0, max(0.05, limit_s / 10))


class Heartbeat:
    """The worker side: a daemon thread that beats until the process ends; ``say`` what the worker now does."""

    def __init__(self, channel: Any, rank: int, limit_s: float) -> None:
        self.channel, self.rank, self.interval = channel, rank, beat_interval(limit_s)
        self.doing = "starting"
        self._lock = threading.Lock()  # two writers of one slot (this thread and the worker's main thread)

    def start(self) -> "Heartbeat":
        threading.Thread(target=self._run, name="llmcli-tp-heartbeat", daemon=True).start()
        return self

    def say(self, doing: str) -> None:
        """Record what the worker does from now on, and beat with it at once."""
        self.doing = doing
        self._beat()

    def _beat(self) -> bool:
        with self._lock:
            try:
                self.channel.beat(self.rank, self.doing)
            except (ValueError, TypeError, OSError):  # the segment is closed: the worker is ending
                return False
        return True

    def _run(self) -> None:
        while self._beat():
            time.sleep(self.interval)


@dataclass
class Silence:
    rank: int
    seconds: float  # since rank 0 last saw its counter move
    doing: str


class SilenceMonitor:
    """Rank 0's side: which rank, if any, has not beaten for ``limit_s`` seconds."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.tick_s = beat_interval(limit_s)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last count, when it changed)

    def silent(self, channel: Any, ranks: list[int]) -> Silence | None:
        now = time.monotonic()
        for rank in ranks:
            try:
                count, doing = channel.read_beat(rank)
            except (ValueError, TypeError, OSError):
                return None
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif count > 0 and now - last[1] > self.limit_s:
                return Silence(rank, now - last[1], doing)
        return None
