"""OpenAI batch output lines: completion / chat.completion bodies and per-request errors."""
from __future__ import annotations

import time
import uuid
from typing import Any

from llmcli.engine.outputs import RequestOutput
from llmcli.cli.io.logprobs_format import (Bytes, chat_logprobs, completion_logprobs, echo_logprobs,
                                          plain_prompt_logprobs)
from llmcli.cli.io.reasoning import OutputSplitter, split_output
from llmcli.cli.io.records import InputRecord


# Where the reasoning parser puts the thinking: vLLM's current name (its PR #27752); "reasoning_content",
# the name before it, with --reasoning-field reasoning_content.
REASONING_FIELD = "reasoning"


def _usage(outputs: list[RequestOutput], prompt_only: bool = False) -> dict[str, Any]:
    prompt = len(outputs[0].prompt_token_ids)
    completion = 0 if prompt_only else sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outputs[0].num_cached_prompt_tokens},
    }


def _choice(index: int, out: RequestOutput, chat: bool, reasoning: str | OutputSplitter | None, k: int | None,
            token_bytes: Bytes | None = None, reasoning_field: str = REASONING_FIELD) -> dict[str, Any]:
    logprobs = None
    if k is not None and out.logprobs is not None:
        logprobs = chat_logprobs(out.token_ids, out.logprobs, k, token_bytes) if chat \
            else completion_logprobs(out.token_ids, out.logprobs, k)
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        finish = out.finish_reason
        if reasoning is not None:  # as vLLM's chat completions carry it, beside the content
            split = split_output(reasoning, out)
            message = {"role": "assistant", "content": split.content, reasoning_field: split.reasoning}
            if split.tool_calls:  # OpenAI's shape; a completion that ended calling a tool says so
                message["tool_calls"] = split.tool_calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}


def _echo_choice(index: int, out: RequestOutput, rec: InputRecord, k: int | None,
                 tokenizer: Any) -> dict[str, Any]:
    """A completions choice with ``echo``: the prompt's text (and its tokens' logprobs) before the completion's;
    with ``max_tokens: 0`` the prompt alone."""
    prompt_ids = out.prompt_token_ids
    prompt_only = rec.openai.echo.prompt_only

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else "".join(f"token_id:{t}" for t in ids)

    prompt_text = rec.prompt if isinstance(rec.prompt, str) else decode(prompt_ids)
    ids, positions = ([], []) if prompt_only else (out.token_ids, out.logprobs or [])
    logprobs = None
    if k is not None and out.prompt_logprobs is not None:
        logprobs = echo_logprobs(prompt_ids, out.prompt_logprobs, decode(prompt_ids[:1]), ids, positions, k)
    return {"index": index, "text": prompt_text + ("" if prompt_only else out.text), "logprobs": logprobs,
            "finish_reason": "length" if prompt_only else out.finish_reason}


def _line(rec: InputRecord, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": rec.openai.custom_id,
        "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def openai_result(rec: InputRecord, outputs: list[RequestOutput], model: str,
                  reasoning: str | OutputSplitter | None = None, token_bytes: Bytes | None = None,
                  reasoning_field: str = REASONING_FIELD) -> dict[str, Any]:
    """The batch output line answering ``rec`` with its n completions (text completions are never split)."""
    chat, echo = rec.openai.chat, rec.openai.echo
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, out, chat, reasoning, rec.sampling.get("logprobs"), token_bytes, reasoning_field)
                    if echo is None else _echo_choice(i, out, rec, rec.sampling.get("logprobs"),
                                                      getattr(token_bytes, "tokenizer", None))
                    for i, out in enumerate(outputs)],
        "usage": _usage(outputs, echo is not None and echo.prompt_only),
    }
    prompt_k = rec.sampling.get("prompt_logprobs")
    if echo is not None and not echo.prompt_logprobs_asked:
        prompt_k = None  # asked for by echo, written in the choices' logprobs
    if prompt_k is not None and outputs[0].prompt_logprobs is not None:  # vLLM's extension
        body["prompt_logprobs"] = plain_prompt_logprobs(outputs[0].prompt_token_ids, outputs[0].prompt_logprobs,
                                                        prompt_k)
    return _line(rec, 200, body)


def openai_error(rec: InputRecord) -> dict[str, Any]:
    """A rejected request: HTTP-style 400 with an OpenAI error body (plus where in the input)."""
    err = rec.error
    body = {"error": {"message": err.message, "type": "invalid_request_error", "param": err.field,
                      "code": None, "line": err.line}}
    return _line(rec, 400, body)
