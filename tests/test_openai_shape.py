"""OpenAI batch output lines, as llmcli writes them and as docs/cli.md shows them, match OpenAI's published shape.

The schema below is written from OpenAI's batch API reference (the output file's line: id, custom_id,
response {status_code, request_id, body}, error) and its chat completion / completion objects (choices,
usage, and the two logprobs shapes). It is deliberately strict about required fields and types.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import orjson
import pytest

from processes import env

REPO = Path(__file__).resolve().parent.parent
NUMBER = {"type": "number"}
TOP_CHAT = {"type": "object", "required": ["token", "logprob", "bytes"],
            "properties": {"token": {"type": "string"}, "logprob": NUMBER,
                           "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
CHAT_LOGPROBS = {"type": "object", "required": ["content"], "properties": {
    "content": {"type": ["array", "null"], "items": {**TOP_CHAT, "required": ["token", "logprob", "bytes",
                                                                                "top_logprobs"],
                                                     "properties": {**TOP_CHAT["properties"],
                                                                    "top_logprobs": {"type": "array",
                                                                                     "items": TOP_CHAT}}}}}}
COMPLETION_LOGPROBS = {"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                       "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                                      "token_logprobs": {"type": "array", "items": NUMBER},
                                      "top_logprobs": {"type": "array", "items": {
                                          "type": "object", "additionalProperties": NUMBER}},
                                      "text_offset": {"type": "array", "items": {"type": "integer"}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
FINISH = {"enum": ["stop", "length", "content_filter", "tool_calls", "function_call"]}
CHAT_BODY = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE,
    "choices": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["index", "message", "finish_reason", "logprobs"], "properties": {
            "index": {"type": "integer"}, "finish_reason": FINISH,
            "message": {"type": "object", "required": ["role", "content"],
                        "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}}},
            "logprobs": {"oneOf": [{"type": "null"}, CHAT_LOGPROBS]}}}}}}
COMPLETION_BODY = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE,
    "choices": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["index", "text", "finish_reason", "logprobs"], "properties": {
            "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": FINISH,
            "logprobs": {"oneOf": [{"type": "null"}, COMPLETION_LOGPROBS]}}}}}}
ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
BATCH_LINE = {"type": "object", "required": ["id", "custom_id", "response", "error"], "properties": {
    "id": {"type": "string"}, "custom_id": {"type": "string"},
    "error": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["code", "message"]}]},
    "response": {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["status_code", "request_id", "body"],
        "properties": {"status_code": {"type": "integer"}, "request_id": {"type": "string"},
                       "body": {"oneOf": [CHAT_BODY, COMPLETION_BODY, ERROR_BODY]}}}]}}}

INPUT = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}},
    {"custom_id": "chat-lp", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
              "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "Once upon", "max_tokens": 3, "temperature": 0}},
    {"custom_id": "cmpl-lp", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "Once upon", "max_tokens": 3, "temperature": 0, "logprobs": 2}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}},
]


def documented_batch_lines() -> list[dict]:
    text = (REPO / "docs" / "cli.md").read_text()
    lines = []
    for block in re.findall(r"```json\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if '"custom_id"' in line and '"response"' in line:
                lines.append(orjson.loads(line))
    return lines


def test_the_schema_rejects_what_openai_would_not_write():
    good = documented_batch_lines()[0]
    jsonschema.validate(good, BATCH_LINE)
    broken = orjson.loads(orjson.dumps(good))
    del broken["response"]["body"]["usage"]["total_tokens"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, BATCH_LINE)


def test_documented_examples_have_openais_shape():
    lines = documented_batch_lines()
    assert len(lines) >= 2
    for line in lines:
        jsonschema.validate(line, BATCH_LINE)


def test_what_llmcli_writes_has_openais_shape(tmp_path):
    src = tmp_path / "batch.jsonl"
    src.write_bytes(b"\n".join(orjson.dumps(r) for r in INPUT) + b"\n")
    out = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "llmcli", "generate", str(src), "-o", str(out), "--model",
                          str(REPO / "examples" / "tiny-qwen3"), "--on-error", "skip", "-q"],
                         env=env(), capture_output=True, timeout=300)
    assert run.returncode == 1, run.stderr.decode()  # one line is invalid on purpose
    lines = {r["custom_id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert set(lines) == {r["custom_id"] for r in INPUT}
    for line in lines.values():
        jsonschema.validate(line, BATCH_LINE)
    assert lines["bad"]["response"]["status_code"] == 400
    chat_lp = lines["chat-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chat_lp) == 3 and all(len(e["top_logprobs"]) == 2 for e in chat_lp)
    message = lines["chat-lp"]["response"]["body"]["choices"][0]["message"]
    if not message.get("reasoning"):  # every token's own bytes join into the text
        assert b"".join(bytes(e["bytes"]) for e in chat_lp) == message["content"].encode("utf-8")
    cmpl_lp = lines["cmpl-lp"]["response"]["body"]["choices"][0]["logprobs"]
    # up to logprobs+1: the sampled token is always there
    assert len(cmpl_lp["tokens"]) == 3 and all(len(t) <= 3 for t in cmpl_lp["top_logprobs"])
    assert all(token in top for token, top in zip(cmpl_lp["tokens"], cmpl_lp["top_logprobs"]))
