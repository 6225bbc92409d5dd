"""Logprobs and penalties through `llmcli generate`: plain records and OpenAI batch lines, compared with
the Python API on the same requests (the API itself is checked against transformers in test_logprobs.py)."""
from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from llmcli import LLM, SamplingParams
from llmcli.cli.app import app

ENGINE = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len", "256"]
KW = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


def run_cli(model, tmp_path, records, *extra):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), "--model", str(model), *ENGINE, *extra])
    return result, [orjson.loads(line) for line in out.read_bytes().splitlines()] if out.exists() else []


@pytest.fixture(scope="module")
def api(tiny_model):
    return LLM(str(tiny_model), **KW)


def test_record_shapes_match_the_api(tiny_model, tmp_path, api):
    chat = [{"role": "user", "content": "hi"}]
    records = [
        {"id": "plain", "prompt": "hello there", "max_tokens": 4, "temperature": 0, "logprobs": 3,
         "prompt_logprobs": 1, "repetition_penalty": 1.5},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                  "frequency_penalty": 0.8}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "logprobs": 2,
                  "presence_penalty": -1.0}},
    ]
    result, (plain, chat_line, cmpl_line) = run_cli(tiny_model, tmp_path, records, "--ignore-eos")
    assert result.exit_code == 0, result.output

    want = api.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                                                        prompt_logprobs=1, repetition_penalty=1.5))[0]
    assert plain["text"] == want.text
    assert [e["token_id"] for e in plain["logprobs"]] == want.token_ids
    for entry, position, token in zip(plain["logprobs"], want.outputs[0].logprobs, want.token_ids):
        assert entry["logprob"] == pytest.approx(position[token].logprob, abs=1e-5)
        top = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [t["token_id"] for t in entry["top_logprobs"]] == [tid for tid, _ in top]
        assert entry["token"] == api.tokenizer.decode([token])
    assert plain["prompt_logprobs"][0] is None and len(plain["prompt_logprobs"]) == len(want.prompt_token_ids)
    assert all(len(e["top_logprobs"]) == 1 for e in plain["prompt_logprobs"][1:])

    text = api.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want = api.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                                               frequency_penalty=0.8))[0]
    choice = chat_line["response"]["body"]["choices"][0]
    assert choice["message"]["content"] == want.text
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and choice["logprobs"]["refusal"] is None
    for item, position, token in zip(content, want.outputs[0].logprobs, want.token_ids):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode()) and item["logprob"] == pytest.approx(
            position[token].logprob, abs=1e-5)
        assert len(item["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]

    want = api.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                                                        presence_penalty=-1.0))[0]
    choice = cmpl_line["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == choice["text"] == want.text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    assert lp["token_logprobs"] == pytest.approx([p[t].logprob for p, t in zip(want.outputs[0].logprobs,
                                                                                want.token_ids)], abs=1e-5)
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


def test_without_logprobs_records_are_unchanged(tiny_model, tmp_path):
    records = [{"id": 1, "prompt": "hi", "max_tokens": 2},
               {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]
    result, (plain, line) = run_cli(tiny_model, tmp_path, records)
    assert result.exit_code == 0, result.output
    assert "logprobs" not in plain and "prompt_logprobs" not in plain
    assert line["response"]["body"]["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("record,field", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": "high"}, "repetition_penalty"),
    ({"custom_id": "c", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}}, "body.top_logprobs"),
])
def test_bad_fields_name_the_line_and_field(tiny_model, tmp_path, record, field):
    result, _ = run_cli(tiny_model, tmp_path, [record])
    assert result.exit_code == 2
    assert f":1: {field}:" in result.output


def test_penalty_flags_reach_the_sampler(tiny_model, tmp_path, api):
    records = [{"prompt": "hello", "max_tokens": 6, "temperature": 0}]
    result, (line,) = run_cli(tiny_model, tmp_path, records, "--ignore-eos", "--frequency-penalty", "-2",
                              "--repetition-penalty", "0.5")
    assert result.exit_code == 0, result.output
    want = api.generate(["hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  frequency_penalty=-2.0, repetition_penalty=0.5))[0]
    plain = api.generate(["hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert line["text"] == want.text != plain.text
    result, _ = run_cli(tiny_model, tmp_path, records, "--presence-penalty", "5")
    assert result.exit_code == 2 and "--presence-penalty" in result.output  # a flag error names the flag
