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
    # --max-tokens is every record's default, OpenAI lines included, and a limit the user set (issue 45)
    req = prepared(tokenizer, chat_line("c"), {"max_tokens": 9})
    assert req.params[0].max_tokens == 9 and req.limit_set


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


# -- item 6: vLLM's request fields, on the device --------------------------------------
KW = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=8,
          max_model_len=256)
PROMPT = [5, 17, 42, 99, 123, 7, 64, 300]
A_IDS = (67, 261)  # the tiny tokenizer's "a" and " a": one token each


def _devices() -> list[str]:
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the device path of the token tables


@pytest.fixture(scope="module", params=_devices())
def llm(tiny_model, request):
    from llmcli import LLM

    engine = LLM(str(tiny_model), **{**KW, "device": request.param})
    yield engine
    engine.shutdown()


def greedy(**kw):
    from llmcli import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kw})


def test_logit_bias_allowed_and_bad_words_in_a_mixed_batch(llm, tokenizer):
    from llmcli import SamplingParams

    assert [tokenizer.encode(w, add_special_tokens=False) for w in ("a", " a")] == [[A_IDS[0]], [A_IDS[1]]]
    plain = llm.generate([PROMPT], greedy())[0].token_ids
    outs = llm.generate([PROMPT] * 5, [
        greedy(logit_bias={"300": 100}),  # OpenAI's string keys
        greedy(allowed_token_ids=[11, 12]),
        SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=[11, 12]),
        greedy(logit_bias={A_IDS[0]: 50, A_IDS[1]: 50}, bad_words=["a"]),
        greedy(),
    ])
    assert outs[0].token_ids == [300] * 6
    assert set(outs[1].token_ids) <= {11, 12} and set(outs[2].token_ids) <= {11, 12}
    assert not set(outs[3].token_ids) & set(A_IDS)
    biased = llm.generate([PROMPT], greedy(logit_bias={A_IDS[0]: 50, A_IDS[1]: 50}))[0].token_ids
    assert set(biased) <= set(A_IDS)  # without the ban the bias wins: the ban is what changed it
    assert outs[4].token_ids == plain  # rows of biased requests leave the others alone


def test_min_tokens_holds_back_eos(llm):
    from llmcli import SamplingParams

    eos = llm.engine.eos_token_ids[0]
    at_once = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})
    assert len(llm.generate([PROMPT], at_once)[0].token_ids) == 1
    (out,) = llm.generate([PROMPT], at_once.replace(min_tokens=5), use_tqdm=False)
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.outputs[0].finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_end(llm):
    long = (PROMPT * 40)[:300]  # longer than max_model_len=256
    (out,) = llm.generate([long], greedy(truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == long[-255:]
    (ref,) = llm.generate([long[-255:]], greedy(max_tokens=1))
    assert out.token_ids == ref.token_ids and out.outputs[0].finish_reason == "length"
    (out,) = llm.generate([long], greedy(truncate_prompt_tokens=10))
    assert out.prompt_token_ids == long[-10:]
    assert out.token_ids == llm.generate([long[-10:]], greedy())[0].token_ids


def test_request_fields_reach_sampling_params(tokenizer):
    req = prepared(tokenizer, chat_line("c", min_tokens=2, include_stop_str_in_output=True,
                                        skip_special_tokens=False, logit_bias={"5": -100}, bad_words=["a"],
                                        allowed_token_ids=[1, 2], truncate_prompt_tokens=4, seed=7))
    p = req.params[0]
    assert (p.min_tokens, p.include_stop_str_in_output, p.skip_special_tokens, p.logit_bias, p.bad_words,
            p.allowed_token_ids, p.truncate_prompt_tokens, p.seed) == (2, True, False, {5: -100}, ["a"], [1, 2], 4, 7)
    assert len(req.prompt_token_ids) == 4
    assert rec_of({"prompt": "x", "min_tokens": 1}).unknown == []


@pytest.mark.parametrize("fields, field, words", [
    ({"bad_words": ["the"]}, "bad_words", "is 2 tokens"),
    ({"logit_bias": {"9999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "-100 to 100"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "must not exceed max_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
])
def test_request_fields_that_cannot_be_honoured_are_errors(tokenizer, fields, field, words):
    rec = rec_of({"prompt": "hi", **fields})
    assert Preparer(tokenizer, 64, 640, {}).prepare(rec) is None
    assert rec.error.field == field and words in rec.error.message, rec.error


# -- item 7: logprobs shapes -----------------------------------------------------------
def test_chat_logprob_bytes_are_each_tokens_own(tokenizer):
    from llmcli.cli.io.logprobs_format import TokenBytes, chat_logprobs
    from llmcli.engine.outputs import Logprob

    text = "naïve € 😀 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # some token holds part of a character
    positions = [{t: Logprob(-0.5, 1, p)} for t, p in zip(ids, pieces)]
    content = chat_logprobs(ids, positions, 0, TokenBytes(tokenizer))["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode("utf-8")


def test_completions_top_logprobs_hold_the_sampled_token():
    from llmcli.cli.io.logprobs_format import completion_logprobs
    from llmcli.engine.outputs import Logprob

    position = {7: Logprob(-3.0, 4, "x"), 1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.5, 2, "b")}
    top = completion_logprobs([7], [position], 2)["top_logprobs"][0]
    assert top == {"x": -3.0, "a": -0.1, "b": -0.5}  # up to logprobs+1
    position = {1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.5, 2, "b")}
    assert completion_logprobs([1], [position], 2)["top_logprobs"][0] == {"a": -0.1, "b": -0.5}


# -- item 8: vLLM's flag spellings ------------------------------------------------------
def test_vllm_flag_spellings(tiny_model, tmp_path):
    from llmcli.config import Config

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    args = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in engine_args(tiny_model)]
    assert "--max_model_len" in args and "--num_kvcache_blocks" in args
    result = runner.invoke(app, ["generate", "--input-file", str(inp), "--output_file", str(out), *args,
                                 "--max_tokens=2", "--trust-remote-code", "--generation-config", "vllm"])
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(out)) == 1
    assert "--trust-remote-code is not needed" in result.stderr
    assert "generation_config.json sets" not in result.stderr  # vllm: the neutral defaults, as ignore
    assert Config(str(tiny_model), device="cpu", generation_config="vllm").sampling_defaults == {}
    # an underscore spelling of no flag is still an error, and values are left alone
    result = runner.invoke(app, ["generate", str(inp), "--max_nothing", "3", *engine_args(tiny_model)])
    assert result.exit_code == 2


# -- item 10: a pipe's reader leaving ------------------------------------------------
def test_closed_pipe_stops_at_once_and_quietly(tiny_model, tmp_path):
    import subprocess
    import time

    from processes import env

    records = [{"prompt_token_ids": PROMPT, "max_tokens": 1}]
    records += [{"prompt_token_ids": PROMPT, "max_tokens": 240, "ignore_eos": True, "seed": i} for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    proc = subprocess.Popen([sys.executable, "-m", "llmcli", "generate", str(inp), "-o", "-", "--unordered",
                             "--temperature", "1", *engine_args(tiny_model)],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = orjson.loads(proc.stdout.readline())
    assert first["id"] == 0
    proc.stdout.close()  # what `| head -1` does once it has its line
    closed = time.monotonic()
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read().decode()
    assert rc == 141, stderr
    assert time.monotonic() - closed < 20  # not after the other 40 x 240 tokens
    assert "Traceback" not in stderr and "output closed" not in stderr and "error" not in stderr.lower()


# -- item 12: small things ---------------------------------------------------------------
def test_stdout_run_does_not_speak_of_answered_records(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 1}] * 2)
    result = runner.invoke(app, ["generate", str(inp), "-o", "-", *engine_args(tiny_model)])
    assert result.exit_code == 0, result.output
    assert "2 records to run" in result.stderr.splitlines()  # and no "(0 already answered in OUT)"


# -- item 11: CPU threads ---------------------------------------------------------------
def test_cpu_thread_rule(monkeypatch):
    from llmcli.engine import cpu_threads as ct

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert ct.cpu_threads(hidden_size=4096) == 6 and ct.cpu_threads(hidden_size=4096, ranks=4) == 1
    assert ct.cpu_threads(hidden_size=64) == 1  # too small for threads to pay
    assert ct.replica_budget(3) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert ct.cpu_threads(hidden_size=64) == 4 and ct.cpu_threads(hidden_size=4096, ranks=2) == 2
    assert ct.replica_budget(2) == 2


def test_cpu_engine_sets_its_threads(tiny_model, monkeypatch):
    import torch

    from llmcli.engine.llm_engine import LLMEngine
    from llmcli.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        LLMEngine(Config(str(tiny_model), **KW))
        assert torch.get_num_threads() == 1  # the tiny model: one thread, whatever torch had
    finally:
        torch.set_num_threads(before)


def test_config_key_typos_get_a_hint(tiny_model, tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('max_num_seq = 4\n[generate]\ntemprature = 0\n')
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(app, ["generate", str(inp), "--config", str(toml), "--model", str(tiny_model)],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert 'max_num_seq (did you mean "max-num-seqs"?)' in text and 'temprature (did you mean "temperature"?)' in text


# -- item 9: output shape ---------------------------------------------------------------
def test_one_plain_shape_whatever_n_and_openai_errors_keep_openai_shape():
    from llmcli.cli.io.output import error_record, result_record
    from llmcli.engine.outputs import RequestOutput

    def out(text, reason):
        return RequestOutput.single(request_id="0.0", prompt_token_ids=[1, 2], token_ids=[3], text=text,
                                    finish_reason=reason)

    rec = rec_of({"prompt": "a", "id": "q"})
    one = result_record(rec, [out("hi", "length")], model="m")
    two = result_record(rec, [out("hi", "length"), out("yo", "stop")], model="m")
    assert (one["text"], one["finish_reason"]) == (two["text"], two["finish_reason"]) == ("hi", "length")
    assert [c["text"] for c in two["choices"]] == ["hi", "yo"]
    bad = rec_of({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}, 3)
    line = error_record(bad)
    # OpenAI's batch output has a string custom_id: a line without one is named by its line number
    assert line["custom_id"] == "line-3" and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["param"] == "custom_id"
    assert "got integer 7" in line["response"]["body"]["error"]["message"]
    from llmcli.cli.io.records import output_key
    assert output_key(line) == bad.key  # --resume knows it is answered


def test_stop_reason_is_none_at_eos_and_the_token_at_a_stop_token(llm):
    from llmcli import SamplingParams

    eos = llm.engine.eos_token_ids[0]
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100},
                                                   skip_special_tokens=False))
    c = out.outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([eos], "stop", None, "")  # as vLLM
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias={300: 100},
                                                   stop_token_ids=[300]))
    c = out.outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([300], "stop", 300, "")


def test_reasoning_goes_to_vllms_current_field_or_the_old_one_on_request(tiny_model, tmp_path):
    from tiny_qwen3 import THINK_CHAT_TEMPLATE

    template = tmp_path / "think.jinja"
    template.write_text(THINK_CHAT_TEMPLATE)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": HI, "max_tokens": 2}])
    fields = {}
    for flag in ([], ["--reasoning-field", "reasoning_content"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        result = runner.invoke(app, ["generate", str(inp), "-o", str(out), "-q", "--chat-template", str(template),
                                     *engine_args(tiny_model), *flag])
        assert result.exit_code == 0, result.output
        fields[len(flag)] = set(read_jsonl(out)[0])
    assert "reasoning" in fields[0] and "reasoning_content" not in fields[0]
    assert "reasoning_content" in fields[2] and "reasoning" not in fields[2]
