"""How many threads torch's CPU kernels get: chosen per engine and per rank, not left to torch's default.

torch's default is every core of the machine, whatever this process may run on and whoever else runs
there. On a busy machine that makes a step wait for the slowest of its threads: a one-record job on
the tiny test model took 0.5 s to 16 s on a loaded 2-core machine with the default, a steady 0.44-0.64 s
with one thread. The rule:

1. ``OMP_NUM_THREADS``, when set, is the thread budget of one engine (all its tensor-parallel ranks);
2. else a model with a hidden size below ``SMALL_HIDDEN`` gets one thread per rank: its matrices are too
   small for more threads to pay, and waiting for them costs more than they save;
3. else the cores this process may run on (its affinity mask, which torch's default ignores).

Tensor-parallel ranks split the budget evenly; data-parallel replicas on one machine split it first
(the local pool hands each replica its share as ``OMP_NUM_THREADS``).
"""
from __future__ import annotations

import os

THREADS_ENV = "OMP_NUM_THREADS"
SMALL_HIDDEN = 1024


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_budget() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, or None when it is unset (or not a number)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def cpu_threads(hidden_size: int, ranks: int = 1) -> int:
    """Threads for each of an engine's ``ranks`` on CPU, by the rule above."""
    budget = thread_budget()
    if budget is None and hidden_size < SMALL_HIDDEN:
        return 1
    return max(1, (budget or usable_cores()) // max(1, ranks))


def replica_budget(replicas: int) -> int:
    """The thread budget of each of ``replicas`` engines sharing this machine's cores."""
    return max(1, (thread_budget() or usable_cores()) // max(1, replicas))
