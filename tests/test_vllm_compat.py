"""Moving a vLLM or OpenAI batch job over (issue 29): OpenAI's defaults, vLLM's field names and flags."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from llmcli.cli.app import app
from llmcli.cli.io.prepare import Preparer
from llmcli.cli.io.records import parse_line
from llmcli.cli.io.source import RawLine
from llmcli.models.hub import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import engine_args, read_jsonl, write_jsonl  # noqa: E402

runner = CliRunner()
HI = [{"role": "user", "content": "hi"}]


def rec_of(obj, number: int = 1):
    return parse_line(RawLine(number, orjson.dumps(obj)))


def chat_line(cid: str, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI, **body}}


def completions_line(cid: str, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello", **body}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def prepared(tokenizer, obj, defaults=None, max_model_len=64):
    rec = rec_of(obj)
    req = Preparer(tokenizer, max_model_len, 640, defaults or {}).prepare(rec)
    assert req is not None, rec.error
    return req


# -- item 1: max_tokens defaults ------------------------------------------------------
def test_default_max_tokens_follow_the_record_kind(tokenizer):
    # OpenAI: chat runs until it stops or the context is full; completions stop at 16
    assert prepared(tokenizer, chat_line("c")).params[0].max_tokens is None
    assert prepared(tokenizer, completions_line("d")).params[0].max_tokens == 16
    assert prepared(tokenizer, {"prompt": "hi"}).params[0].max_tokens == 256
    req = prepared(tokenizer, chat_line("c", max_completion_tokens=7))
    assert req.params[0].max_tokens == 7 and req.limit_set
    # --max-tokens is every record's default, OpenAI lines included, but not a limit the record set
    req = prepared(tokenizer, chat_line("c"), {"max_tokens": 9})
    assert req.params[0].max_tokens == 9 and not req.limit_set


def test_summary_counts_records_cut_at_a_default_limit(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line("chat"), completions_line("cmpl"), {"prompt": "x"},
                                              {"prompt": "y", "max_tokens": 3}])
    out = tmp_path / "out.jsonl"
    args = [a if a != "256" else "48" for a in engine_args(tiny_model)]  # --max-model-len 48
    result = runner.invoke(app, ["generate", str(inp), "-o", str(out), *args, "--ignore-eos"])
    assert result.exit_code == 0, result.output
    chat, cmpl, plain, capped = read_jsonl(out)
    usage = chat["response"]["body"]["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 48  # the context is full
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] == 16
    assert plain["usage"]["prompt_tokens"] + plain["usage"]["completion_tokens"] == 48
    assert capped["usage"]["completion_tokens"] == 3
    assert re.search(r"cut at a default length limit\s*│?\s*3\b", result.stderr), result.stderr
    assert "3 records stopped at a length limit they do not set" in result.stderr


# -- items 2 and 3: vLLM's structured_outputs, guided_* in OpenAI bodies ----------------
@pytest.mark.parametrize("wrap", [lambda so: {"prompt": "x", "structured_outputs": so},
                                  lambda so: chat_line("c", structured_outputs=so)])
def test_structured_outputs_field_is_read(wrap):
    for so, kind in (({"json": {"type": "object"}}, "json"), ({"regex": "a+", "json": None}, "regex"),
                     ({"choice": ["a", "b"]}, "choice"), ({"grammar": 'start: "a"'}, "grammar"),
                     ({"json_object": True, "disable_fallback": True}, "json_object")):
        r = rec_of(wrap(so))
        assert r.error is None and r.unknown == [] and r.sampling["structured_outputs"].kind == kind


@pytest.mark.parametrize("so, field, words", [
    ({"structural_tag": '{"type": "structural_tag"}'}, "structured_outputs.structural_tag", "not supported"),
    ({"json": {}, "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"regx": "a"}, "structured_outputs.regx", "unknown constraint"),
    ("a+", "structured_outputs", "must be an object"),
])
def test_structured_outputs_that_cannot_be_honoured_are_input_errors(so, field, words):
    r = rec_of({"prompt": "x", "structured_outputs": so})
    assert r.error is not None and r.error.field == field and words in r.error.message, r.error
    r = rec_of(chat_line("c", structured_outputs=so))
    assert r.error is not None and r.error.field == "body." + field


def test_guided_fields_in_an_openai_body_are_used_not_reported_unknown():
    r = rec_of(chat_line("c", guided_choice=["a", "b"], guided_decoding_backend="xgrammar"))
    assert r.error is None and r.sampling["structured_outputs"].choice == ("a", "b")
    assert r.unknown == ["body.guided_decoding_backend"]


def test_cli_honours_structured_outputs(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "choice", "prompt": "Mood:", "structured_outputs": {"choice": ["happy", "sad"]}, "seed": 1},
        chat_line("regex", structured_outputs={"regex": "[0-9]{3}-[0-9]{2}"}, seed=2),
    ])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["generate", str(inp), "-o", str(out), *engine_args(tiny_model), "--strict"])
    assert result.exit_code == 0, result.output
    choice, regex = read_jsonl(out)
    assert choice["text"] in ("happy", "sad")
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", regex["response"]["body"]["choices"][0]["message"]["content"])


# -- item 5: top_k 0 is off ------------------------------------------------------------
def test_top_k_zero_means_off(tokenizer):
    from llmcli import SamplingParams

    assert SamplingParams(top_k=0).top_k == -1 and "top_k" not in SamplingParams(top_k=0).unset
    assert prepared(tokenizer, {"prompt": "hi", "top_k": 0}).params[0].top_k == -1
    assert prepared(tokenizer, chat_line("c", top_k=0)).params[0].top_k == -1
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
