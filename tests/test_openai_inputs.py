"""OpenAI batch input fields (issue 42): completions' echo with prompt logprobs and max_tokens 0, chat tools
passed to the template, tool-call history, fields llmcli cannot honour refused, custom_id never null."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmcli.cli.app import app
from tiny_qwen3 import CHAT_TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import engine_args, read_jsonl, write_jsonl  # noqa: E402

runner = CliRunner()
PROMPT = "the quick brown fox jumps"


def completions(cid: str, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT, **body}}


def chat(cid: str, messages, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": messages, **body}}


def run(model, tmp_path, lines, *extra):
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["generate", str(inp), "-o", str(out), *engine_args(model), "--on-error", "skip",
                                 "--temperature", "0", *extra])
    assert result.exit_code in (0, 1), result.output
    return {line["custom_id"]: line for line in read_jsonl(out)}


@pytest.fixture(scope="module")
def answers(tiny_model, tmp_path_factory):
    return run(tiny_model, tmp_path_factory.mktemp("echo"), [
        completions("echo", echo=True, logprobs=1, max_tokens=3),
        completions("plain", logprobs=1, max_tokens=3),
        completions("prompt-only", echo=True, logprobs=0, max_tokens=0),
        completions("zero", max_tokens=0),
        completions("best", best_of=2),
        completions("suffix", suffix="!"),
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    ])


def test_echo_writes_the_prompt_and_its_logprobs_first(answers, tiny_model, hf_oracle):
    tok = hf_oracle.tokenizer(tiny_model)
    ids = tok(PROMPT)["input_ids"]
    echo = answers["echo"]["response"]["body"]["choices"][0]
    plain = answers["plain"]["response"]["body"]["choices"][0]
    assert echo["text"] == PROMPT + plain["text"]
    lp = echo["logprobs"]
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:len(ids)]) == PROMPT and lp["text_offset"][len(ids)] == len(PROMPT)
    for i in range(1, len(ids)):  # transformers' log-softmax of the token given the prompt before it
        want = torch.log_softmax(hf_oracle.next_token_logits(tiny_model, ids[:i]), -1)[ids[i]].item()
        assert lp["token_logprobs"][i] == pytest.approx(want, abs=1e-4)
        assert len(lp["top_logprobs"][i]) in (1, 2)
    assert "prompt_logprobs" not in answers["echo"]["response"]["body"]


def test_echo_with_max_tokens_zero_answers_the_prompt_alone(answers):
    body = answers["prompt-only"]["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["logprobs"]["token_logprobs"][0] is None
    assert "".join(choice["logprobs"]["tokens"]) == PROMPT
    assert body["usage"]["completion_tokens"] == 0
    zero = answers["zero"]["response"]
    assert zero["status_code"] == 400 and zero["body"]["error"]["param"] == "body.max_tokens"


def test_fields_llmcli_cannot_honour_are_errors_and_custom_id_is_never_null(answers):
    for cid, field in (("best", "body.best_of"), ("suffix", "body.suffix")):
        err = answers[cid]["response"]
        assert err["status_code"] == 400 and err["body"]["error"]["param"] == field
    missing = answers["line-7"]
    assert missing["custom_id"] == "line-7" and missing["response"]["body"]["error"]["param"] == "custom_id"


def test_tools_reach_the_chat_template_and_tool_history_is_accepted(tiny_model, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text("{% if tools %}{% for t in tools %}{{ '<|im_start|>system\\n' + t['function']['name'] "
                        "+ '<|im_end|>\\n' }}{% endfor %}{% endif %}" + CHAT_TEMPLATE)
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "the weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    got = run(tiny_model, tmp_path, [
        chat("tools", hi, tools=tools, tool_choice="auto", max_tokens=4),
        chat("system", [{"role": "system", "content": "the weather"}, *hi], max_tokens=4),
        chat("history", [*hi, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], max_tokens=2),
        chat("forced", hi, tools=tools, tool_choice="required"),
    ], "--chat-template", str(template))
    a, b = got["tools"]["response"]["body"], got["system"]["response"]["body"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert got["history"]["response"]["status_code"] == 200
    forced = got["forced"]["response"]
    assert forced["status_code"] == 400 and forced["body"]["error"]["param"] == "body.tool_choice"
