"""Errors the data-parallel driver and its replica pools share (a module of its own so that neither imports the other)."""
from __future__ import annotations

import logging

from llmcli.config import ConfigError

log = logging.getLogger("llmcli")


class DataParallelError(RuntimeError):
    """The data-parallel replicas cannot go on (none left, or one failed to start); the message says why."""


class ReplicaFailure(str):
    """The error of a request given up on because the replicas that ran it failed (not a fault of its fields)."""


def raise_startup_failure(index: int, where: str, kind: str, message: str, text: str) -> None:
    """Re-raise a replica's start-up failure in the driver, as the kind of error it was."""
    log.debug("data-parallel replica %d failed to start:\n%s", index, text)
    if kind == "config":
        raise ConfigError(message)
    if kind == "model":
        from llmcli.models.hub import ModelNotFoundError

        raise ModelNotFoundError(f"data-parallel replica {index} on {where}: {message}")
    last = text.strip().splitlines()[-1] if text.strip() else message
    raise DataParallelError(f"data-parallel replica {index} failed to start on {where}: {last}")
