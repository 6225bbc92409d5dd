"""The error of a command that cannot start as asked (exit code 2)."""
from __future__ import annotations


class UsageError(Exception):
    """The command cannot start as asked (exit code 2); the message says what to change."""
