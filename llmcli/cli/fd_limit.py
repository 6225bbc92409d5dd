"""Enough open files for the processes asked for: the soft limit raised when the hard one allows, else one line.

Each tensor-parallel rank and data-parallel replica costs its parents pipes,
sockets and shared-memory handles; run out half way and the failure is a
traceback from deep inside torch.distributed or a rendezvous that retries for
minutes. The estimate is generous (what a run needs is well below it).
"""
from __future__ import annotations

import resource

from llmcli.cli.usage_error import UsageError

BASE_FILES = 64  # the process itself: libraries, the model's files, IN, OUT and their side files
PER_RANK = 16  # each tensor-parallel rank: its pipes, sockets and the control channel
PER_REPLICA = 8  # each data-parallel replica: two pipes and its process handle


def files_needed(tensor_parallel_size: int, data_parallel_size: int) -> int:
    return BASE_FILES + PER_RANK * tensor_parallel_size + PER_REPLICA * data_parallel_size


def ensure_open_files(tensor_parallel_size: int, data_parallel_size: int) -> None:
    """Raise the soft RLIMIT_NOFILE to what ``-tp``/``-dp`` need (children inherit it); UsageError when the
    hard limit is below that."""
    if tensor_parallel_size * data_parallel_size <= 1:
        return
    need = files_needed(tensor_parallel_size, data_parallel_size)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    asked = " ".join(f"{flag} {n}" for flag, n in (("-tp", tensor_parallel_size), ("-dp", data_parallel_size))
                     if n > 1)
    raise UsageError(f"{asked} needs about {need} open files, but the "
                     f"limit on open files is {hard} (ulimit -n); raise it with `ulimit -n {need}` (as root or "
                     "through /etc/security/limits.conf when the hard limit is lower) and run again")
