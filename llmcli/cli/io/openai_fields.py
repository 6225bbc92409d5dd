"""OpenAI body fields beyond sampling: completions' ``echo``, chat's ``tools``, and the fields llmcli cannot
honour, each refused with the reason (a dropped field would be a silently different answer)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmcli.cli.io.field_problem import FieldProblem

# field -> (values that change nothing, why any other value cannot be honoured)
UNHONOURED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "best_of is not supported: ask for n completions and pick with their logprobs"),
    "suffix": ((None, ""), "suffix (insertion) is not supported by the models llmcli runs"),
    "stream": ((None, False), "a batch file has no stream: each line is answered whole"),
    "stream_options": ((None,), "a batch file has no stream"),
    "functions": ((None,), "the legacy functions field is not supported; use tools"),
    "function_call": ((None,), "the legacy function_call field is not supported; use tool_choice"),
    "audio": ((None,), "audio output is not supported (text-only models)"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
# fields that change no answer: accepted as they are
HARMLESS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# tool_choice values under which the template's tools are only offered (no tool call is forced)
OFFERED = (None, "auto", "none")
OPENAI_ONLY_FIELDS = ("echo", "tools", "tool_choice", *UNHONOURED, *HARMLESS)


@dataclass
class Echo:
    """``echo: true`` on /v1/completions: the prompt is written before the completion; ``prompt_only``:
    ``max_tokens: 0`` (allowed with echo, as vLLM does), so the answer is the prompt alone."""

    prompt_only: bool = False
    prompt_logprobs_asked: bool = False  # the line asked for vLLM's prompt_logprobs too (written beside)


def _same(value: Any, fine: tuple) -> bool:
    return any(value is f or (type(value) is type(f) and value == f) for f in fine)


def check_unhonoured(body: dict[str, Any]) -> None:
    """Raise FieldProblem for the first field whose value llmcli cannot honour."""
    for name, (fine, why) in UNHONOURED.items():
        if name in body and not _same(body[name], fine):
            raise FieldProblem(f"body.{name}", why)


def take_echo(body: dict[str, Any], sampling: dict[str, Any]) -> Echo | None:
    """Read ``echo`` (completions): with ``logprobs: k`` the prompt's tokens get theirs (``prompt_logprobs``);
    ``max_tokens: 0`` runs one token and answers with the prompt alone. Changes ``sampling`` in place."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise FieldProblem("body.echo", "must be true or false")
    if sampling.get("max_tokens") == 0:
        if not echo:
            raise FieldProblem("body.max_tokens", "0 needs \"echo\": true (the answer is then the prompt alone)")
        if sampling.get("n", 1) != 1:
            raise FieldProblem("body.n", "must be 1 with max_tokens 0 (every completion would be the prompt)")
        sampling["max_tokens"] = 1
    if not echo:
        return None
    asked = sampling.get("prompt_logprobs") is not None
    if sampling.get("logprobs") is not None:
        prompt_k = sampling.setdefault("prompt_logprobs", sampling["logprobs"])
        if prompt_k != sampling["logprobs"]:
            raise FieldProblem("body.prompt_logprobs", "must equal logprobs with echo (one top list per token)")
    return Echo(prompt_only=body.get("max_tokens") == 0, prompt_logprobs_asked=asked)


def take_tools(body: dict[str, Any], kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat ``tools`` go to the chat template (as vLLM hands them over); a ``tool_choice`` that forces a call
    is refused, since llmcli parses no tool calls out of the text."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise FieldProblem("body.tools", "must be an array of tool objects")
    if not _same(choice, OFFERED):
        raise FieldProblem("body.tool_choice", "only \"auto\" or \"none\" are supported: forcing a tool call "
                                               "needs a tool-call parser, which llmcli does not have")
    if choice is not None and not tools:
        raise FieldProblem("body.tool_choice", "needs tools")
    if not tools:
        return kwargs
    return {**(kwargs or {}), "tools": tools}
