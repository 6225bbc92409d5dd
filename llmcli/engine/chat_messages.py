"""Chat messages as the chat template reads them, as vLLM hands them over: text content parts joined by
newlines, an assistant turn's ``content: null`` beside its ``tool_calls`` as "", tool-call arguments as objects."""
from __future__ import annotations

import json
from typing import Any

PART_SEPARATOR = "\n"  # vLLM renders [{"type": "text", ...}, ...] as the texts joined by newlines


# OpenAI chat's image part, the Responses API's, and the bare form some datasets write
IMAGE_PARTS = ("image_url", "input_image", "image")
NO_IMAGES = "llmcli runs the language model only and reads no images (a multimodal checkpoint's vision tower " \
            "is not loaded)"


class ContentPartError(ValueError):
    """A content part that is not text; ``index`` is its position in the message's content."""

    def __init__(self, index: int, part: Any = None) -> None:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            message = f'an image part ("type": "{kind}"): {NO_IMAGES}; give the text alone'
        elif isinstance(kind, str) and kind != "text":
            message = (f'a part of type "{kind}": only {{"type": "text", "text": ...}} parts are supported '
                       "(a text-only model)")
        else:
            message = 'only {"type": "text", "text": ...} parts are supported (a text-only model)'
        super().__init__(message)
        self.index = index


def content_text(content: Any) -> Any:
    """``content`` with a list of text parts joined into one string; anything else returned unchanged."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ContentPartError(j, part)
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """One message as the template reads it. Raises ContentPartError (a part that is not text) or
    ValueError (``content`` missing or null outside an assistant turn with ``tool_calls``)."""
    content = content_text(msg.get("content"))
    calls = msg.get("tool_calls")
    if content is None and msg.get("role") == "assistant" and isinstance(calls, list) and calls:
        content = ""
    elif content is None:
        raise ValueError("content: must be a string or a list of text parts (null only in an assistant turn "
                         "with tool_calls)")
    out = {**msg, "content": content}
    if isinstance(calls, list):
        # chat templates index the arguments (tool_call.arguments.items()); OpenAI sends them as JSON text
        out["tool_calls"] = [_parsed_arguments(call) for call in calls]
    return out


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def template_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the template reads it (``template_message`` for each)."""
    out = []
    for i, msg in enumerate(conversation):
        try:
            out.append(template_message(msg))
        except ContentPartError as exc:
            raise ValueError(f"message {i}: content[{exc.index}]: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"message {i}: {exc}") from None
    return out
