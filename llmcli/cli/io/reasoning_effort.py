"""``reasoning_effort``, a chat template variable (gpt-oss's Harmony template reads it; OpenAI's chat field):
from a record's field or its ``chat_template_kwargs``, and from ``--reasoning-effort``, each value checked."""
from __future__ import annotations

from typing import Any

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.cli.usage_error import UsageError
from llmcli.engine.harmony import reasoning_effort_problem


def take_reasoning_effort(src: dict[str, Any], prefix: str, kwargs: dict[str, Any] | None,
                          chat: bool) -> dict[str, Any] | None:
    """The chat template's kwargs with the record's ``reasoning_effort`` (OpenAI's field; a Harmony template,
    gpt-oss's, reads it), each value checked where it was given."""
    inner = (kwargs or {}).get("reasoning_effort")
    if inner is not None and (why := reasoning_effort_problem(inner)):
        raise FieldProblem(prefix + "chat_template_kwargs.reasoning_effort", why)
    value = src.get("reasoning_effort")
    if value is None:
        return kwargs
    name = prefix + "reasoning_effort"
    if (why := reasoning_effort_problem(value)):
        raise FieldProblem(name, why)
    if not chat:
        raise FieldProblem(name, "applies to chat records (messages): it is a chat template variable")
    if inner is not None and inner != value:
        raise FieldProblem(name, f"conflicts with chat_template_kwargs.reasoning_effort ({inner!r})")
    return {**(kwargs or {}), "reasoning_effort": value}


def check_flag_effort(in_kwargs: Any, flag: str | None) -> None:
    """--chat-template-kwargs' reasoning_effort is one the template takes, and agrees with --reasoning-effort."""
    if in_kwargs is None:
        return
    if (why := reasoning_effort_problem(in_kwargs)):
        raise UsageError(f"--chat-template-kwargs: reasoning_effort {why}")
    if flag is not None and flag != in_kwargs:
        raise UsageError(f"--reasoning-effort {flag} and --chat-template-kwargs' reasoning_effort {in_kwargs!r}: "
                         "give one")
