"""Type checks of record field values: the sampling fields and what each must be, the prompt fields (messages,
token ids, text), and how a wrong value is named in a one-line error."""
from __future__ import annotations

from typing import Any, Callable

import orjson

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.engine.chat_messages import ContentPartError, template_message

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_stop(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(t) for t in v)


SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (is_number, "a number"),
    "top_p": (is_number, "a number"),
    "top_k": (is_int, "an integer"),
    "min_p": (is_number, "a number"),
    "max_tokens": (lambda v: v is None or is_int(v), "an integer or null"),
    "stop": (is_stop, "a string or a list of strings"),
    "stop_token_ids": (is_int_list, "a list of integers"),
    "seed": (lambda v: v is None or is_int(v), "an integer or null"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "n": (is_int, "an integer"),
    "logprobs": (lambda v: v is None or is_int(v), "an integer from 0 to 20 or null"),
    "prompt_logprobs": (lambda v: v is None or is_int(v), "an integer from 0 to 20 or null"),
    "repetition_penalty": (is_number, "a number"),
    "presence_penalty": (is_number, "a number"),
    "frequency_penalty": (is_number, "a number"),
    "min_tokens": (is_int, "an integer"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "logit_bias": (lambda v: v is None or (isinstance(v, dict) and all(is_number(x) for x in v.values())),
                   "an object of token id: number"),
    "bad_words": (lambda v: v is None or is_stop(v), "a string or a list of strings"),
    "allowed_token_ids": (lambda v: v is None or is_int_list(v), "a list of integers or null"),
    "truncate_prompt_tokens": (lambda v: v is None or is_int(v), "an integer or null"),
    "skip_reading_prefix_cache": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "thinking_token_budget": (lambda v: v is None or is_int(v), "an integer or null"),
}
SAMPLING_FIELDS = tuple(SAMPLING_CHECKS)


def type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def take_sampling(src: dict[str, Any], prefix: str) -> dict[str, Any]:
    found = {}
    for name, (check, wanted) in SAMPLING_CHECKS.items():
        if name in src:
            value = src[name]
            if not check(value):
                raise FieldProblem(prefix + name, f"must be {wanted}, got {describe(value)}")
            found[name] = value
    return found


def describe(value: Any) -> str:
    # JSON integers past 64 bits are read as floats: say so rather than blame a number the user never wrote.
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        return f"an integer too large for 64 bits ({short(value)})"
    return f"{type_name(value)} {short(value)}"


def short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


# -- prompts --------------------------------------------------------------------
def check_messages(messages: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise FieldProblem(name, "must be a non-empty array of {role, content} objects")
    checked = []
    for i, msg in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise FieldProblem(where, f"must be an object, got {type_name(msg)}")
        if not isinstance(msg.get("role"), str):
            raise FieldProblem(f"{where}.role", "must be a string")
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise FieldProblem(f"{where}.tool_calls", "must be an array of tool-call objects")
        try:  # OpenAI content parts (only text, for a text-only model); null beside tool_calls
            msg = template_message(msg)
        except ContentPartError as exc:
            raise FieldProblem(f"{where}.content[{exc.index}]", str(exc)) from None
        except ValueError:
            raise FieldProblem(f"{where}.content", f"must be a string, got {type_name(msg.get('content'))}"
                               + (" (null only in an assistant turn with tool_calls)"
                                  if msg.get("content") is None else "")) from None
        if not isinstance(msg["content"], str):
            raise FieldProblem(f"{where}.content", f"must be a string, got {type_name(msg['content'])}")
        checked.append(msg)
    return checked


def check_token_ids(ids: Any, name: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise FieldProblem(name, "must be a non-empty array of token ids")
    for i, t in enumerate(ids):
        if not is_int(t) or t < 0:
            raise FieldProblem(name, f"item {i} must be a non-negative integer, got {describe(t)}")
    return ids


def check_text(text: Any, name: str) -> str:
    if not isinstance(text, str):
        raise FieldProblem(name, f"must be a string, got {type_name(text)}")
    if not text:
        raise FieldProblem(name, "is empty")
    return text
