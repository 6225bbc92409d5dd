"""Start-up errors whose message is the whole story (a damaged checkpoint, a bad config.json, too little memory).

A tensor-parallel rank or a data-parallel replica that meets one sends ``(name, message)`` to the driver, which
raises the same error again: every way of starting prints the one line a single process prints.
"""
from __future__ import annotations

import json

TAG = "llmcli start-up error: "  # the line a rank appends to the traceback in its error slot


def _classes() -> dict[str, type[Exception]]:
    from llmcli.config import ConfigError
    from llmcli.engine.memory_check import HostMemoryTooSmall
    from llmcli.models.config_checks import ModelConfigError
    from llmcli.models.hub import ModelNotFoundError
    from llmcli.models.loader import CheckpointError

    return {c.__name__: c for c in (ConfigError, CheckpointError, ModelConfigError, ModelNotFoundError,
                                    HostMemoryTooSmall)}


def plain_error(exc: BaseException) -> tuple[str, str] | None:
    """``(class name, message)`` when ``exc`` is one of these errors, else None."""
    for name, cls in _classes().items():
        if type(exc) is cls:
            return name, str(exc)
    return None


def rebuild(name: str, message: str) -> Exception | None:
    """The error ``plain_error`` described, raised again in this process (None for a name it does not know)."""
    cls = _classes().get(name)
    return cls(message) if cls is not None else None


def tag_line(exc: BaseException) -> str:
    """The line a rank writes after its traceback for one of these errors ("" for any other)."""
    plain = plain_error(exc)
    return f"\n{TAG}{json.dumps(plain)}" if plain is not None else ""


def from_text(text: str) -> Exception | None:
    """The error a rank's error text carries in its tag line, if any."""
    for line in reversed(text.splitlines()):
        if line.startswith(TAG):
            try:
                name, message = json.loads(line[len(TAG):])
            except (ValueError, TypeError):
                return None
            return rebuild(str(name), str(message))
    return None
