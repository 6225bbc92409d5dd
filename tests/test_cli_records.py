"""Unit tests of the CLI's record handling, writer, resume scan, output shapes and helpers (no engine)."""
from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from llmcli.engine.outputs import MemoryReport, RequestOutput
from llmcli.cli.io.output import error_record, result_record
from llmcli.cli.io.prepare import Preparer
from llmcli.models.hub import load_tokenizer
from llmcli.cli.io.records import mark_duplicates, output_key, parse_line
from llmcli.cli.io.resume import ResumeError, scan_output
from llmcli.cli.io.source import RawLine, read_lines
from llmcli.cli.io.writer import LineSink, RecordWriter

REPO = Path(__file__).resolve().parent.parent


def rec_of(obj, number: int = 1):
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return parse_line(RawLine(number, data))


def fake_output(rid="0.0", prompt=(1, 2, 3), tokens=(7, 8), text="hi", reason="length"):
    return RequestOutput.single(request_id=rid, prompt_token_ids=list(prompt), token_ids=list(tokens), text=text,
                         finish_reason=reason)


# -- parsing ----------------------------------------------------------------------
def test_every_input_kind_parses():
    r = rec_of({"prompt": "hello", "id": "a", "temperature": 0.5, "stop": "x"}, 3)
    assert (r.kind, r.prompt, r.out_id, r.error) == ("prompt", "hello", "a", None)
    assert r.sampling == {"temperature": 0.5, "stop": "x"}
    r = rec_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, 5)
    assert r.kind == "messages" and r.prompt[0]["content"] == "a\nb" and r.out_id == 4  # 0-based line index
    r = rec_of({"prompt_token_ids": [1, 2, 3], "n": 2, "seed": 1})
    assert (r.kind, r.prompt, r.sampling) == ("prompt_token_ids", [1, 2, 3], {"n": 2, "seed": 1})
    r = rec_of({"prompt": [4, 5]})  # OpenAI's token-id form under "prompt"
    assert (r.kind, r.prompt) == ("prompt_token_ids", [4, 5])


def test_openai_lines_parse():
    r = rec_of({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                         "temperature": 0, "n": 2, "logprobs": False}})
    assert r.error is None and r.openai.chat and r.out_id == "req-1" and r.kind == "messages"
    assert r.sampling == {"temperature": 0, "n": 2, "max_tokens": 9}
    r = rec_of({"custom_id": "req-2", "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": ["only one"], "max_tokens": 4, "stop": ["\n"], "seed": 3}})
    assert r.error is None and not r.openai.chat and r.prompt == "only one"
    assert r.key == output_key({"custom_id": "req-2", "response": {}})


@pytest.mark.parametrize("obj, field, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"text": "no prompt here"}, "prompt", "missing"),
    ({"prompt": 5}, "prompt", "must be a string"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "a", "messages": []}, "messages", "conflicts"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": "a", "ignore_eos": 1}, "ignore_eos", "true or false"),
    ({"prompt": "a", "id": [1]}, "id", "string or an integer"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "must be a string"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids", "non-negative"),
    ({"custom_id": "x", "url": "/v1/embeddings", "body": {}}, "url", "must be one of"),
    ({"custom_id": "x", "url": "/v1/completions", "method": "GET", "body": {}}, "method", "POST"),
    ({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "a", "temperature": "1"}}, "body.temperature", "number"),
    ({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}, "body.prompt", "one prompt per line"),
    ({"custom_id": 7, "url": "/v1/completions", "body": {"prompt": "a"}}, "custom_id", "string"),
])
def test_malformed_lines_name_the_field(obj, field, words):
    r = rec_of(obj, 7)
    assert r.error is not None and r.error.field == field and words in r.error.message
    assert r.error.line == 7
    assert r.error.describe("in.jsonl").startswith(f"in.jsonl:7: {field + ': ' if field else ''}")


def test_duplicate_ids_are_errors():
    recs = [rec_of({"prompt": "a", "id": "x"}, 1), rec_of({"prompt": "b", "id": "x"}, 2), rec_of({"prompt": "c"}, 3)]
    mark_duplicates(recs)
    assert recs[0].error is None and recs[2].error is None
    assert recs[1].error.field == "id" and "first used on line 1" in recs[1].error.message


def test_read_lines_skips_blank_lines_but_keeps_numbers(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"prompt": "a"}\n\n  \r\n{"prompt": "b"}\r\n')
    assert [(l.number, l.data) for l in read_lines(str(f))] == [(1, b'{"prompt": "a"}'), (4, b'{"prompt": "b"}')]


# -- prepare (needs only the tokenizer) ---------------------------------------------
@pytest.fixture(scope="module")
def preparer(tiny_model):
    tok = load_tokenizer(tiny_model)
    return Preparer(tok, max_model_len=64, vocab_size=640, defaults={"max_tokens": 5, "temperature": 0.7})


def test_prepare_encodes_and_merges_sampling(preparer):
    req = preparer.prepare(rec_of({"prompt": "The quick brown fox", "temperature": 0}))
    assert req.prompt_token_ids and req.params[0].temperature == 0 and req.params[0].max_tokens == 5
    req = preparer.prepare(rec_of({"messages": [{"role": "user", "content": "hi"}]}))
    text = preparer.tokenizer.decode(req.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    req = preparer.prepare(rec_of({"prompt_token_ids": [1, 2], "n": 3, "seed": 10}))
    assert [p.seed for p in req.params] == [10, 11, 12] and all(p.n == 1 for p in req.params)


def test_prepare_errors_name_the_field(preparer):
    r = rec_of({"prompt": "the " * 100})
    assert preparer.prepare(r) is None and r.error.field == "prompt" and "max_model_len=64" in r.error.message
    r = rec_of({"prompt_token_ids": [1, 9999]})
    assert preparer.prepare(r) is None and r.error.field == "prompt_token_ids" and "vocabulary" in r.error.message
    r = rec_of({"prompt": "a", "top_p": 0})
    assert preparer.prepare(r) is None and r.error.field == "top_p"
    r = rec_of({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "temperature": -1}})
    assert preparer.prepare(r) is None and r.error.field == "body.temperature"
    r = rec_of({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "the " * 100}})
    assert preparer.prepare(r) is None and r.error.field == "body.prompt"


def test_chat_template_override(preparer):
    custom = Preparer(preparer.tokenizer, 64, 640, {}, chat_template="Q: {{ messages[-1]['content'] }} A:")
    req = custom.prepare(rec_of({"messages": [{"role": "user", "content": "hi"}]}))
    assert preparer.tokenizer.decode(req.prompt_token_ids) == "Q: hi A:"
    broken = Preparer(preparer.tokenizer, 64, 640, {}, chat_template="{{ messages[0]['content'] | nosuchfilter }}")
    r = rec_of({"messages": [{"role": "user", "content": "hi"}]})
    assert broken.prepare(r) is None and r.error.field == "messages" and "chat template" in r.error.message


def test_prepare_without_tokenizer_wants_token_ids():
    p = Preparer(None, 64, 100, {})
    r = rec_of({"prompt": "text"})
    assert p.prepare(r) is None and "no tokenizer" in r.error.message
    assert p.prepare(rec_of({"prompt_token_ids": [1, 2]})) is not None


# -- output shapes ------------------------------------------------------------------
def test_plain_output_shapes():
    r = rec_of({"prompt": "a", "id": "q"})
    line = result_record(r, [fake_output()], model="m", include_token_ids=True)
    assert line == {"id": "q", "text": "hi", "finish_reason": "length", "token_ids": [7, 8],
                    "prompt_token_ids": [1, 2, 3], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                             "total_tokens": 5}}
    line = result_record(r, [fake_output(), fake_output(text="yo", reason="stop", tokens=(1,))], model="m")
    assert line["choices"] == [{"index": 0, "text": "hi", "finish_reason": "length"},
                               {"index": 1, "text": "yo", "finish_reason": "stop"}]
    assert line["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    bad = rec_of({"prompt": 1}, 4)
    assert error_record(bad) == {"id": 3, "error": {"message": bad.error.message, "line": 4, "field": "prompt"}}


def test_openai_output_shapes():
    chat = rec_of({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}})
    line = result_record(chat, [fake_output()], model="m")
    assert set(line) == {"id", "custom_id", "response", "error"} and line["custom_id"] == "c" and line["error"] is None
    body = line["response"]["body"]
    assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"]["total_tokens"] == 5
    comp = rec_of({"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "x"}})
    body = result_record(comp, [fake_output(), fake_output()], model="m")["response"]["body"]
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1]
    bad = rec_of({"custom_id": "e", "url": "/v1/completions", "body": {"prompt": 3}})
    err = error_record(bad)
    assert err["custom_id"] == "e" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "body.prompt"


# -- writer and resume --------------------------------------------------------------
def test_writer_ordered_unordered_and_drain():
    buf = io.BytesIO()
    w = RecordWriter(LineSink(buf, durable=False, owned=False), ordered=True)
    w.put(1, {"id": 1})
    w.put(3, {"id": 3})
    assert buf.getvalue() == b""
    w.put(0, {"id": 0})
    assert [orjson.loads(l)["id"] for l in buf.getvalue().splitlines()] == [0, 1]
    w.drain()  # on interrupt: the held record goes out across the gap at 2
    assert [orjson.loads(l)["id"] for l in buf.getvalue().splitlines()] == [0, 1, 3]
    buf = io.BytesIO()
    w = RecordWriter(LineSink(buf, durable=False, owned=False), ordered=False)
    w.put(5, {"id": 5})
    w.put(2, {"id": 2})
    assert buf.getvalue() == b'{"id":5}\n{"id":2}\n'


def test_resume_scan_truncates_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id":0,"text":"a"}\n{"id":"x","error":{}}\n{"id":"bat","custom_id":"c","response":{}}\n{"id":5,"te')
    state = scan_output(out)
    assert state.answered == {"id:0", 'id:"x"', 'custom_id:"c"'} and state.truncated_bytes == len(b'{"id":5,"te')
    assert out.read_bytes().endswith(b"}\n")
    out.write_bytes(b'{"id":0}\n{oops}\n{"id":1}\n')
    with pytest.raises(ResumeError, match="out.jsonl:2"):
        scan_output(out)
    assert scan_output(tmp_path / "missing.jsonl").answered == set()


# -- probe hint, bench helpers, shared options, presets ------------------------------
def memory_report(**kw):
    base = dict(device="cuda:0", device_name="GPU", total_bytes=80 << 30, budget_bytes=72 << 30,
                weights_bytes=60 << 30, activation_peak_bytes=12 << 30, cuda_graph_bytes=0, other_bytes=1 << 30,
                kv_bytes_per_token=1 << 17, kv_bytes_per_block=(1 << 17) * 256, block_size=256, num_blocks=0,
                cache_tokens=0, max_model_len=4096, max_concurrent_full_seqs=0.0, dtype="bfloat16")
    base.update(kw)
    return MemoryReport(**base)


def test_probe_hint_says_which_knob_and_how_much():
    from llmcli.cli.probe import fit_hint, report_dict

    hint = fit_hint(memory_report(), {"gpu_memory_utilization": 0.9})
    assert "empty" in hint and "--gpu-memory-utilization from 0.90 to at least 0.92" in hint
    assert "--max-num-batched-tokens" in hint
    hint = fit_hint(memory_report(device="cpu", total_bytes=0), {})
    assert "--kv-cache-memory-gib to at least 0.50" in hint
    hint = fit_hint(memory_report(num_blocks=4, cache_tokens=1024), {"num_kvcache_blocks": 4})
    assert "--num-kvcache-blocks to at least 16" in hint and "--max-model-len to at most 1024" in hint
    assert fit_hint(memory_report(num_blocks=16, cache_tokens=4096), {}) is None
    assert set(report_dict(memory_report(), {})) >= {"num_blocks", "kv_bytes_per_block", "cache_tokens", "hint"}


def test_bench_workload_helpers():
    from llmcli.cli.bench import Workload, make_requests, parse_length, percentiles, request_params, unique_prompt_tokens
    from llmcli.cli.generate import UsageError

    assert parse_length("100:1024", "--input-len") == (100, 1024) and parse_length("7", "x") == (7, 7)
    for bad in ("0", "5:4", "a:b"):
        with pytest.raises(UsageError):
            parse_length(bad, "--input-len")
    w = Workload(num_prompts=20, input_len=(5, 9), output_len=(3, 4), prefix_len=2)
    reqs = make_requests(w, 50, avoid={0, 1})
    assert reqs == make_requests(w, 50, avoid={0, 1})  # seeded
    assert all(7 <= len(ids) <= 11 and 3 <= n <= 4 and not {0, 1} & set(ids) for ids, n in reqs)
    assert len({tuple(ids[:2]) for ids, _ in reqs}) == 1  # the shared prefix
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5 and 3.9 < p["p99"] <= 4.0
    # a perfect prefix cache's work: every distinct prefix of every prompt once
    prefixes = {tuple(ids[:j]) for ids, _ in reqs + reqs[:3] for j in range(1, len(ids) + 1)}
    assert unique_prompt_tokens(reqs + reqs[:3]) == len(prefixes)
    # --sampling: Qwen3's filters on every request, on every other one, or on none
    for mode, filtered in (("plain", []), ("qwen3-defaults", [0, 1, 2, 3]), ("mixed", [0, 2])):
        params = [request_params(Workload(sampling=mode), i, 5) for i in range(4)]
        assert [i for i, sp in enumerate(params) if (sp.top_k, sp.top_p) == (20, 0.95)] == filtered
        assert all((sp.top_k, sp.top_p) == (-1, 1.0) for i, sp in enumerate(params) if i not in filtered)


def test_every_engine_knob_is_a_flag():
    from llmcli.cli.options import ENGINE_KNOBS
    from llmcli.config import Config

    assert sorted(k.name for k in ENGINE_KNOBS) == sorted(Config.knob_names())


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_presets_use_known_keys(preset):
    import tomllib

    import typer.main

    from llmcli.cli.app import app

    command = typer.main.get_command(app).commands["bench"]
    names = {opt.lstrip("-").replace("-", "_") for p in command.params for opt in p.opts}
    data = tomllib.loads(preset.read_text())
    keys = [k for k, v in data.items() if not isinstance(v, dict)] + list(data.get("bench", {}))
    assert {k.replace("-", "_") for k in keys} <= names


@pytest.mark.parametrize("name, layers, tied", [("Qwen3-0.6B", 28, True), ("Qwen3-1.7B", 28, True),
                                                ("Qwen3-4B", 36, True), ("Qwen3-8B", 36, False),
                                                ("Qwen3-14B", 40, False), ("Qwen3-32B", 64, False)])
def test_model_configs_are_qwen3(name, layers, tied):
    cfg = orjson.loads((REPO / "configs" / name / "config.json").read_bytes())
    gen = orjson.loads((REPO / "configs" / name / "generation_config.json").read_bytes())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == layers
    assert cfg["tie_word_embeddings"] is tied and cfg["head_dim"] == 128 and cfg["vocab_size"] == 151936
    assert cfg["max_position_embeddings"] == 40960 and cfg["eos_token_id"] == 151645
    assert gen["eos_token_id"] == [151645, 151643]
