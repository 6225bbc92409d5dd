"""Errors the data-parallel driver and its replica pools share (a module of its own so that neither imports the other)."""
from __future__ import annotations

import logging

from llmcli.engine.startup_errors import rebuild

log = logging.getLogger("llmcli")


class DataParallelError(RuntimeError):
    """The data-parallel replicas cannot go on (none left, or one failed to start); the message says why."""


class ReplicaFailure(str):
    """The error of a request given up on because the replicas that ran it failed (not a fault of its fields)."""


def raise_startup_failure(index: int, where: str, kind: str, message: str, text: str) -> None:
    """Re-raise a replica's start-up failure in the driver, as the kind of error it was."""
    log.debug("data-parallel replica %d failed to start:\n%s", index, text)
    error = rebuild(kind, message)  # the same one line a single process prints (a damaged checkpoint...)
    if error is not None:
        raise error
    last = text.strip().splitlines()[-1] if text.strip() else message
    raise DataParallelError(f"data-parallel replica {index} failed to start on {where}: {last}")
