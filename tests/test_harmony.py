"""Harmony, gpt-oss's chat format: its messages read from token ids (analysis → reasoning, final → text, tool
calls), its stops, reasoning_effort in the template, and structured outputs that shape the final answer only,
on the tiny gpt-oss checkpoint whose template and special tokens are Harmony's (tests/tiny_qwen3.py)."""
from __future__ import annotations

import jsonschema
import orjson
import pytest

from test_cli import generate, read_jsonl, write_jsonl

from llmcli.cli.io.reasoning import OutputSplitter, choose_parser
from llmcli.engine.harmony import HarmonyTokens
from llmcli.engine.outputs import RequestOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint):
    return tiny_checkpoint("gpt-oss")


@pytest.fixture(scope="module")
def tok(gpt_oss):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpt_oss)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


HI = "<|start|>user<|message|>hi<|end|><|start|>assistant"


def split(tok, completion: str, finish: str = "stop", prompt: str = HI):
    out = RequestOutput.single(0, ids(tok, prompt), ids(tok, completion), "(decoded)", finish)
    return OutputSplitter("harmony", tok).split(out)


def test_the_parser_reads_channels_from_token_ids(tok):
    both = split(tok, "<|channel|>analysis<|message|>The user says hi. Answer briefly.<|end|>"
                      "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
    assert (both.reasoning, both.content, both.tool_calls) == ("The user says hi. Answer briefly.",
                                                                "Hello! How can I help?", [])
    only_final = split(tok, "<|channel|>final<|message|>Hello.<|return|>")
    assert (only_final.reasoning, only_final.content) == (None, "Hello.")
    # a length limit inside the analysis: what was produced is the reasoning, the answer is empty
    cut = split(tok, "<|channel|>analysis<|message|>The user says hi. I should", finish="length")
    assert (cut.reasoning, cut.content) == ("The user says hi. I should", "")
    # cut inside the final header: the analysis is whole, still no answer
    header_cut = split(tok, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>fin")
    assert (header_cut.reasoning, header_cut.content) == ("Think.", "")
    first_header_cut = split(tok, "<|channel|>analy", finish="length")
    assert (first_header_cut.reasoning, first_header_cut.content) == (None, "")
    # text that looks like markers but is not made of the special tokens stays content
    assert split(tok, "<|channel|>final<|message|>use analysis then final<|return|>").content == \
        "use analysis then final"


def test_commentary_is_a_tool_call_or_a_preamble(tok):
    found = split(tok, "<|channel|>analysis<|message|>Need the weather.<|end|>"
                       "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
                       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                       "<|message|>{\"city\": \"Paris\"}<|call|>")
    assert found.reasoning == "Need the weather."
    assert found.content == "Let me check."  # a preamble is written for the user
    assert found.tool_calls == [{"id": "call_0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    # the recipient may stand in the role part of the header too
    other = split(tok, "<|channel|>commentary to=functions.lookup<|message|>{}<|call|>")
    assert other.tool_calls[0]["function"]["name"] == "lookup" and other.content == ""


def test_a_completion_without_harmony_messages_is_all_text(tok):
    out = RequestOutput.single(0, [], ids(tok, "just some words"), "just some words", "length")
    found = OutputSplitter("harmony", tok).split(out)
    assert (found.reasoning, found.content) == (None, "just some words")


def test_auto_picks_harmony_for_a_harmony_template(tok):
    assert choose_parser("auto", tok.chat_template) == "harmony"
    assert choose_parser("auto", "{{ '<think>' }}") == "qwen3"


def _llm(model):
    from llmcli import LLM

    return LLM(str(model), device="cpu", max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=16)


def test_end_stops_after_the_final_message_only(gpt_oss, tok):
    """<|end|> closes every message; the generation ends at the one closing the final channel, not after the
    analysis (there the model goes on to its answer)."""
    from llmcli import SamplingParams

    llm = _llm(gpt_oss)
    end = HarmonyTokens.of(tok).end
    head = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>"
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={end: 100})
    final, analysis = llm.generate([{"prompt_token_ids": ids(tok, head + "final<|message|>")},
                                    {"prompt_token_ids": ids(tok, head + "analysis<|message|>")}], params)
    assert final.outputs[0].token_ids == [end] and final.outputs[0].finish_reason == "stop"
    assert analysis.outputs[0].token_ids[0] == end and analysis.outputs[0].finish_reason == "length"
    # <|return|> and <|call|> are EOS (generation_config.json lists them)
    assert {HarmonyTokens.of(tok).ret, HarmonyTokens.of(tok).call} <= set(llm.engine.eos_token_ids)


def _read(tok, token_ids: list[int]) -> tuple[str, list[int], list[int]]:
    """The test's own reading of a constrained completion: the first header's channel, the first message's
    content ids, and the second message's (each found by the positions of the special tokens)."""
    h = HarmonyTokens.of(tok)
    m1 = token_ids.index(h.message)
    channel = tok.decode(token_ids[token_ids.index(h.channel) + 1:m1])
    if channel == "final":
        return channel, [], token_ids[m1 + 1:]
    e1 = token_ids.index(h.end)
    m2 = token_ids.index(h.message, e1)
    assert tok.decode(token_ids[e1 + 1:m2], skip_special_tokens=False) == "<|start|>assistant<|channel|>final"
    return channel, token_ids[m1 + 1:e1], token_ids[m2 + 1:]


@pytest.mark.slow
def test_json_schema_shapes_the_final_answer_after_free_reasoning(gpt_oss, tok, tmp_path):
    """64 chat records with a JSON schema: each analysis is free text within its thinking budget, the final
    message valid JSON under the schema; reasoning and text are those two messages' contents."""
    budget = 12
    an = ids(tok, "analysis")[0]  # leaning the header towards analysis, so every record reasons
    records = [{"id": i, "messages": [{"role": "user", "content": f"Describe person number {i}."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                "thinking_token_budget": budget, "seed": i, "logit_bias": {str(an): 8}} for i in range(64)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = generate(gpt_oss, inp, out, "--max-tokens", "120", "--temperature", "1", "--include-token-ids")
    assert result.exit_code == 0, result.output
    lines = read_jsonl(out)
    assert len(lines) == 64
    reasoned = 0
    for line in lines:
        assert line["finish_reason"] == "stop", line
        data = orjson.loads(line["text"])
        jsonschema.validate(data, SCHEMA)
        channel, thought, answer = _read(tok, line["token_ids"])
        # the grammar ends the request where the JSON is complete (or at <|return|>, the one token it then allows)
        assert tok.decode([t for t in answer if t != HarmonyTokens.of(tok).ret]) == line["text"]
        if channel == "analysis":
            reasoned += 1
            assert 0 < len(thought) <= budget
            assert line["reasoning"] == tok.decode(thought)
            assert not line["reasoning"].lstrip().startswith("{")  # not the schema's JSON: free text
        else:
            assert line["reasoning"] is None
    assert reasoned == 64
    assert len({line["reasoning"] for line in lines}) > 32  # sampled freely, not forced


def test_constraint_without_budget_and_budget_zero(gpt_oss, tok):
    """Without a budget the analysis runs until the model ends it (here the length limit: reasoning kept, no
    answer, finish length); a budget of 0 answers at once, without reasoning."""
    from llmcli import SamplingParams
    from llmcli.sampling_params import StructuredOutputsParams

    llm = _llm(gpt_oss)
    an = ids(tok, "analysis")[0]
    chat = [{"role": "user", "content": "hello"}]
    spec = StructuredOutputsParams(json=SCHEMA)
    long = llm.chat(chat, SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec,
                                         logit_bias={an: 8}))[0]
    assert long.outputs[0].finish_reason == "length"
    found = OutputSplitter("harmony", tok).split(long)
    assert found.reasoning and found.content == ""
    none = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec,
                                         thinking_token_budget=0, logit_bias={an: 8}))[0]
    found = OutputSplitter("harmony", tok).split(none)
    assert found.reasoning is None and none.outputs[0].finish_reason == "stop"
    jsonschema.validate(orjson.loads(found.content), SCHEMA)


def test_reasoning_effort_reaches_the_prompt(gpt_oss, tok, tmp_path):
    records = [{"id": "flag", "messages": [{"role": "user", "content": "hi"}]},
               {"id": "own", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
               {"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "medium",
                         "max_tokens": 2}}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = generate(gpt_oss, inp, out, "--max-tokens", "2", "--reasoning-effort", "high", "--include-token-ids")
    assert result.exit_code == 0, result.output
    flag, own, oa = read_jsonl(out)
    assert "Reasoning: high" in tok.decode(flag["prompt_token_ids"])
    assert "Reasoning: low" in tok.decode(own["prompt_token_ids"])
    assert oa["response"]["body"]["usage"]["prompt_tokens"] == len(_prompt(tok, "medium")) != len(_prompt(tok, "high"))


def _prompt(tok, effort: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                   reasoning_effort=effort)
    assert f"Reasoning: {effort}" in text
    return ids(tok, text)


def test_bad_reasoning_effort_is_an_input_error_naming_line_and_field(gpt_oss, tmp_path):
    records = [{"id": 0, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
               {"id": 1, "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"reasoning_effort": 3}},
               {"id": 2, "prompt": "hi", "reasoning_effort": "low"},
               {"id": 3, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                "chat_template_kwargs": {"reasoning_effort": "high"}},
               {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"}}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = generate(gpt_oss, inp, out, "--max-tokens", "2")
    assert result.exit_code == 2
    for line, field in ((1, "reasoning_effort"), (2, "chat_template_kwargs.reasoning_effort"),
                        (3, "reasoning_effort"), (4, "reasoning_effort"), (5, "body.reasoning_effort")):
        assert f"in.jsonl:{line}: {field}:" in result.output, result.output
    assert "must be one of low, medium, high, got 'extreme'" in result.output
    bad_flag = generate(gpt_oss, inp, out, "--reasoning-effort", "max")
    assert bad_flag.exit_code == 2 and "--reasoning-effort" in bad_flag.output
    conflict = generate(gpt_oss, inp, out, "--reasoning-effort", "low", "--chat-template-kwargs",
                        '{"reasoning_effort": "high"}')
    assert conflict.exit_code == 2 and "give one" in conflict.output


def test_chat_api_checks_reasoning_effort(gpt_oss):
    llm = _llm(gpt_oss)
    with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, high"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"reasoning_effort": "huge"})


def test_thinking_budget_needs_a_harmony_model(tiny_model):
    from llmcli import SamplingParams
    from llmcli.engine.sequence import RequestRejected

    llm = _llm(tiny_model)
    with pytest.raises(RequestRejected, match="thinking_token_budget needs a model"):
        llm.engine.add_request("hello", SamplingParams(max_tokens=4, thinking_token_budget=8))


def test_tool_calls_in_plain_and_openai_chat_lines(tok):
    from test_cli_ux import rec_of

    from llmcli.cli.io.output import result_record

    completion = ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
                  "to=functions.lookup <|constrain|>json<|message|>{\"q\": \"x\"}<|call|>")
    out = RequestOutput.single(0, ids(tok, HI), ids(tok, completion), "(decoded)", "stop")
    splitter = OutputSplitter("harmony", tok)
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}
    plain = result_record(rec_of({"messages": [{"role": "user", "content": "hi"}]}), [out], model="m",
                          reasoning=splitter)
    assert (plain["text"], plain["reasoning"], plain["tool_calls"]) == ("", "Look it up.", [call])
    chat = rec_of({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": [{"role": "user", "content": "hi"}]}})
    choice = result_record(chat, [out], model="m", reasoning=splitter)["response"]["body"]["choices"][0]
    assert choice["message"]["tool_calls"] == [call] and choice["message"]["reasoning"] == "Look it up."
    assert choice["finish_reason"] == "tool_calls"


def test_read_output_splits_a_python_api_output(gpt_oss, tok):
    from llmcli import SamplingParams
    from llmcli.engine.harmony import read_output
    from llmcli.sampling_params import StructuredOutputsParams

    llm = _llm(gpt_oss)
    an = ids(tok, "analysis")[0]
    params = SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=5, logit_bias={an: 8},
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.chat([{"role": "user", "content": "yes or no?"}], params)[0]
    found = read_output(out, llm.get_tokenizer())
    assert found.text in ("yes", "no") and found.text != out.outputs[0].text and found.reasoning
    assert read_output(out, None) is None


def test_harmony_parser_on_a_model_without_harmony_tokens_is_a_usage_error(tiny_model, tmp_path):
    inp, out = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}]), tmp_path / "out.jsonl"
    result = generate(tiny_model, inp, out, "--reasoning-parser", "harmony")
    assert result.exit_code == 2 and "needs a tokenizer with Harmony's special tokens" in result.output


def test_end_after_the_final_message_waits_for_min_tokens(gpt_oss, tok):
    from llmcli import SamplingParams

    llm = _llm(gpt_oss)
    end = HarmonyTokens.of(tok).end
    prompt = ids(tok, HI + "<|channel|>final<|message|>")
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=4, min_tokens=2, logit_bias={end: 100}))[0]
    # the first <|end|> comes before min_tokens, so the generation goes on; the next closes no final message
    assert out.outputs[0].token_ids[0] == end and len(out.outputs[0].token_ids) == 4


def test_thinking_budget_on_a_model_without_harmony_is_an_input_error(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                              {"messages": [{"role": "user", "content": "hi"}],
                                               "thinking_token_budget": 8}])
    out = tmp_path / "out.jsonl"
    result = generate(tiny_model, inp, out)
    assert result.exit_code == 2 and "in.jsonl:2: thinking_token_budget: needs a model whose chat format" \
        in result.output, result.output
    flag = generate(tiny_model, inp, out, "--thinking-token-budget", "8")
    assert flag.exit_code == 2 and "--thinking-token-budget needs a model" in flag.output, flag.output


def test_reasoning_effort_on_a_template_that_ignores_it_is_noted(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from llmcli.cli.app import app
    from test_cli import engine_args

    inp, out = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]), \
        tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), *engine_args(tiny_model),
                                      "--max-tokens", "2", "--reasoning-effort", "high"])
    assert result.exit_code == 0, result.output
    assert "never reads reasoning_effort" in result.output


def test_an_end_listed_as_eos_still_ends_only_the_final_message(gpt_oss, tok, tmp_path):
    """A conversion whose generation_config.json lists <|end|> among its EOS ids would stop every generation
    after the analysis; llmcli keeps the Harmony rule instead."""
    import json
    import shutil

    from llmcli import SamplingParams

    model = shutil.copytree(gpt_oss, tmp_path / "end_as_eos")
    h = HarmonyTokens.of(tok)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [h.end, h.ret]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = _llm(model)
    assert h.end not in llm.engine.eos_token_ids and h.call in llm.engine.eos_token_ids
    head = HI + "<|channel|>"
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={h.end: 100})
    analysis, final = llm.generate([{"prompt_token_ids": ids(tok, head + "analysis<|message|>")},
                                    {"prompt_token_ids": ids(tok, head + "final<|message|>")}], params)
    assert analysis.outputs[0].finish_reason == "length" and final.outputs[0].token_ids == [h.end]
