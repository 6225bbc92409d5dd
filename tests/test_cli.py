"""The llmcli command line through Typer's CliRunner, on a tiny random Qwen3 on CPU."""
from __future__ import annotations

import re
from pathlib import Path

import orjson
from typer.testing import CliRunner

from llmcli.cli.app import app

runner = CliRunner()
TOKENS = [5, 17, 42, 99, 123, 7, 64, 300]


def engine_args(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--num-kvcache-blocks", "128", "--kvcache-block-size", "16",
            "--max-num-seqs", "8", "--max-model-len", "256", *extra]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_bytes(b"".join(r if isinstance(r, bytes) else orjson.dumps(r) + b"\n" for r in records))
    return path


def read_jsonl(path_or_text) -> list[dict]:
    data = path_or_text.read_bytes() if isinstance(path_or_text, Path) else path_or_text.encode()
    assert not data or data.endswith(b"\n"), "output must end with a whole line"
    return [orjson.loads(line) for line in data.splitlines()]


def generate(tiny_model, inp, out, *flags):
    return runner.invoke(app, ["generate", str(inp), "-o", str(out), *engine_args(tiny_model), "-q", *flags])


def test_help_for_every_command():
    for cmd, words in (("generate", ["--resume", "--unordered", "--on-error", "--max-num-seqs"]),
                       ("bench", ["--num-prompts", "--input-len", "--prefix-len", "--json", "--max-num-seqs"]),
                       ("probe-memory", ["--json", "--gpu-memory-utilization", "--config"])):
        result = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        for word in words:
            assert word in result.stdout


def test_every_input_kind_round_trips(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "The quick brown fox", "id": "p"},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "id": "m"},
        {"prompt_token_ids": TOKENS, "id": 77},
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "n": 2}},
        {"prompt": "no id here"},
    ])
    out = tmp_path / "out.jsonl"
    result = generate(tiny_model, inp, out, "--max-tokens", "4", "--ignore-eos", "--include-token-ids")
    assert result.exit_code == 0, result.output
    lines = read_jsonl(out)
    assert [l.get("custom_id", l["id"]) for l in lines] == ["p", "m", 77, "chat-1", "cmpl-1", 5]
    for line in lines[:3] + lines[5:]:
        assert set(line) == {"id", "text", "finish_reason", "usage", "token_ids", "prompt_token_ids"}
        assert line["finish_reason"] == "length" and len(line["token_ids"]) == 4
        assert line["usage"]["completion_tokens"] == 4 and line["usage"]["prompt_tokens"] > 0
    assert lines[2]["usage"]["prompt_tokens"] == len(TOKENS) and lines[2]["prompt_token_ids"] == TOKENS
    chat, cmpl = lines[3], lines[4]
    for line in (chat, cmpl):
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_") and line["response"]["status_code"] == 200
        assert set(line["response"]["body"]) >= {"id", "object", "created", "model", "choices", "usage"}
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 3
    body = cmpl["response"]["body"]
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6


def test_chat_template_file(tiny_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "The quick brown fox"}]}])
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "The quick brown fox"}])
    templated = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q", "--max-tokens", "1",
                                    "--chat-template", str(template)])
    direct = runner.invoke(app, ["generate", str(plain), *engine_args(tiny_model), "-q", "--max-tokens", "1"])
    assert templated.exit_code == 0 and direct.exit_code == 0, templated.output + direct.output
    assert read_jsonl(templated.stdout)[0]["usage"] == read_jsonl(direct.stdout)[0]["usage"]


def test_text_matches_the_engine(tiny_model, tmp_path):
    from llmcli.config import Config
    from llmcli.engine.llm_engine import LLMEngine
    from llmcli.sampling_params import SamplingParams

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS}])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q", "--temperature", "0",
                                 "--max-tokens", "6", "--ignore-eos", "--include-token-ids"])
    assert result.exit_code == 0, result.output
    [line] = read_jsonl(result.stdout)
    engine = LLMEngine(Config(str(tiny_model), device="cpu", num_kvcache_blocks=64, kvcache_block_size=16))
    engine.add_request(TOKENS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id=0)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.shutdown()
    assert line["token_ids"] == outs[0].token_ids and line["text"] == outs[0].text


def test_per_record_overrides_take_effect(tiny_model, tmp_path):
    sampled = {"prompt_token_ids": TOKENS, "temperature": 1.0, "max_tokens": 5, "ignore_eos": True}
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt_token_ids": TOKENS, "max_tokens": 3},
        {"prompt_token_ids": TOKENS},
        {**sampled, "n": 3, "seed": 11},
        {**sampled, "seed": 11},
        {**sampled, "seed": 12},
    ])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q", "--temperature", "0",
                                 "--max-tokens", "6", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    lines = read_jsonl(result.stdout)
    assert lines[0]["usage"]["completion_tokens"] == 3 and lines[1]["usage"]["completion_tokens"] == 6
    choices = lines[2]["choices"]
    assert len(choices) == 3 and lines[2]["usage"]["completion_tokens"] == 15
    # The i-th of n completions is seeded seed+i: the same as a single request with that seed.
    assert choices[0]["text"] == lines[3]["text"] and choices[1]["text"] == lines[4]["text"]


def test_stop_string_per_record(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS, "temperature": 0, "max_tokens": 12,
                                               "ignore_eos": True}])
    first = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q"])
    text = read_jsonl(first.stdout)[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"need a printable stop string in {text!r}"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS, "temperature": 0, "max_tokens": 12,
                                               "ignore_eos": True, "stop": [stop]}])
    second = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q"])
    line = read_jsonl(second.stdout)[0]
    assert line["finish_reason"] == "stop" and line["text"] == text[:text.index(stop)]


def test_ordered_and_unordered_output(tiny_model, tmp_path):
    records = [{"prompt_token_ids": TOKENS, "max_tokens": 12, "ignore_eos": True, "id": "slow"}]
    records += [{"prompt_token_ids": TOKENS[:3 + i], "max_tokens": 1, "ignore_eos": True} for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    ordered = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q"])
    assert ordered.exit_code == 0, ordered.output
    assert [l["id"] for l in read_jsonl(ordered.stdout)] == ["slow", 1, 2, 3, 4, 5]
    unordered = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q", "--unordered"])
    ids = [l["id"] for l in read_jsonl(unordered.stdout)]
    assert sorted(map(str, ids)) == sorted(map(str, ["slow", 1, 2, 3, 4, 5])) and ids[-1] == "slow"


def test_stdin_to_stdout(tiny_model):
    data = b'{"prompt": "The quick brown fox"}\n{"prompt_token_ids": [1, 2, 3]}\n'
    result = runner.invoke(app, ["generate", "-", "-o", "-", *engine_args(tiny_model), "--max-tokens", "2"],
                           input=data)
    assert result.exit_code == 0, result.output
    assert [l["id"] for l in read_jsonl(result.stdout)] == [0, 1]
    assert "requests answered" in result.stderr  # the summary goes to stderr, never stdout


MALFORMED = [
    {"prompt": "fine"},
    b"{this is not json\n",
    {"text": "where is the prompt?"},
    {"prompt": "x", "temperature": "hot"},
    {"prompt_token_ids": list(range(1, 300))},  # too long for --max-model-len 256
    {"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 5}},
]


def test_malformed_input_fails_before_generating(tiny_model, tmp_path):
    # The engine starts while the input is checked; a bad input stops it (see test_cli_pipeline for leftovers).
    inp = write_jsonl(tmp_path / "in.jsonl", MALFORMED)
    out = tmp_path / "out.jsonl"
    result = generate(tiny_model, inp, out)
    assert result.exit_code == 2, result.output
    err = result.stderr
    for expected in (f"{inp}:2: not valid JSON", f"{inp}:3: prompt: missing", f"{inp}:4: temperature: must be a number",
                     f"{inp}:5: prompt_token_ids: prompt is 299 tokens", f"{inp}:6: body.top_p:",
                     "5 of 6 input records are invalid"):
        assert expected in err, err
    assert not out.exists() or out.read_bytes() == b""


def test_malformed_input_skip_writes_error_records(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", MALFORMED)
    out = tmp_path / "out.jsonl"
    result = generate(tiny_model, inp, out, "--on-error", "skip", "--max-tokens", "2")
    assert result.exit_code == 1, result.output
    lines = read_jsonl(out)
    assert [l.get("custom_id", l.get("id")) for l in lines] == [0, 1, 2, 3, 4, "o"]
    assert "text" in lines[0] and "error" not in lines[0]
    assert [l["error"]["field"] for l in lines[1:5]] == [None, "prompt", "temperature", "prompt_token_ids"]
    assert [l["error"]["line"] for l in lines[1:5]] == [2, 3, 4, 5]
    assert lines[5]["response"]["status_code"] == 400
    assert lines[5]["response"]["body"]["error"]["param"] == "body.top_p"


def test_existing_output_needs_resume_or_overwrite(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS}])
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "old"}\n')
    result = generate(tiny_model, inp, out)
    assert result.exit_code == 2 and "--resume" in result.stderr and "--overwrite" in result.stderr
    assert out.read_bytes() == b'{"id": "old"}\n'
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 1}])
    result = generate(tiny_model, bad, out, "--overwrite")  # refused input: the old OUT is not lost either
    assert result.exit_code == 2 and out.read_bytes() == b'{"id": "old"}\n'
    result = generate(tiny_model, inp, out, "--overwrite", "--max-tokens", "2")
    assert result.exit_code == 0 and [l["id"] for l in read_jsonl(out)] == [0]


def test_resume_completes_each_input_exactly_once(tiny_model, tmp_path):
    records = [{"prompt_token_ids": TOKENS[: 2 + i % 6], "temperature": 0, "max_tokens": 3, "ignore_eos": True}
               for i in range(8)]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    full = tmp_path / "full.jsonl"
    assert generate(tiny_model, inp, full).exit_code == 0
    lines = full.read_bytes().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_bytes(lines[0] + lines[3] + lines[5][:7])  # as a crash leaves it: some done, a torn tail
    result = generate(tiny_model, inp, part, "--resume")
    assert result.exit_code == 0, result.output
    resumed = read_jsonl(part)
    assert sorted(l["id"] for l in resumed) == list(range(8))
    assert {orjson.dumps(l) for l in resumed} == {orjson.dumps(orjson.loads(l)) for l in lines}  # greedy: same answers
    again = generate(tiny_model, inp, part, "--resume")  # nothing left to do
    assert again.exit_code == 0 and len(read_jsonl(part)) == 8


def test_config_file_defaults_and_flag_override(tiny_model, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{tiny_model}"\ndevice = "cpu"\nnum-kvcache-blocks = 64\nkvcache-block-size = 16\n'
                    '[generate]\nmax-tokens = 3\nignore-eos = true\nquiet = true\n')
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS}])
    result = runner.invoke(app, ["generate", str(inp), "--config", str(toml)])
    assert result.exit_code == 0, result.output
    assert read_jsonl(result.stdout)[0]["usage"]["completion_tokens"] == 3
    result = runner.invoke(app, ["generate", str(inp), "--config", str(toml), "--max-tokens", "5"])
    assert read_jsonl(result.stdout)[0]["usage"]["completion_tokens"] == 5
    toml.write_text('model = "x"\nmax-tokenz = 3\n')
    result = runner.invoke(app, ["generate", str(inp), "--config", str(toml)])
    assert result.exit_code == 2 and "max-tokenz" in result.output


def test_usage_errors_exit_2(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--temperature", "-1"])
    assert result.exit_code == 2 and "temperature" in result.stderr
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--dtype", "float8"])
    assert result.exit_code == 2 and "dtype" in result.stderr
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model)[2:], "--model", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "nope" in result.stderr
    result = runner.invoke(app, ["generate", str(tmp_path / "missing.jsonl"), *engine_args(tiny_model)])
    assert result.exit_code == 2 and "missing.jsonl" in result.stderr
    result = runner.invoke(app, ["generate", str(inp), "-o", "-", "--resume", *engine_args(tiny_model)])
    assert result.exit_code == 2 and "--resume" in result.stderr


def test_progress_and_summary_on_stderr(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": TOKENS, "max_tokens": 2}] * 3)
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--progress"])
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(result.stdout)) == 3
    for word in ("requests answered", "generated tokens/s", "prefix-cache hit rate", "wall time"):
        assert word in result.stderr
    # not a terminal: plain lines, the last one the final state (3 records x 2 tokens, all done)
    assert re.search(r"generate: 3/3 records written, 100% of 6 tokens, .* done after 0:00:\d\d\n", result.stderr)
    assert "━" not in result.stderr


BENCH_KEYS = {"model", "device", "dtype", "num_requests", "elapsed_s", "requests_per_s", "input_tokens",
              "output_tokens", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_ms",
              "tpot_ms", "latency_ms", "prefix_cache_hit_rate", "num_preemptions", "kv_cache", "workload", "engine"}


def test_bench_json(tiny_model, tmp_path):
    saved = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", *engine_args(tiny_model), "--load-format", "dummy", "--num-prompts", "6",
                                 "--input-len", "8:24", "--output-len", "4", "--prefix-len", "16", "--warmup", "1",
                                 # prefill first, so that every token after a request's first is a decode step's
                                 "--no-mixed-steps", "--sampling", "mixed", "--json", "--output", str(saved)])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert data["workload"]["sampling"] == "mixed"
    # every prompt is run through the model but for its cached blocks; a perfect cache runs the unique tokens
    assert data["unique_prompt_tokens"] <= data["prompt_tokens_computed"] < data["input_tokens"]
    assert set(data) >= BENCH_KEYS and orjson.loads(saved.read_bytes()) == data
    assert data["num_requests"] == 6 and data["output_tokens"] == 24
    assert set(data["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and data["tpot_ms"]["p50"] > 0
    assert data["prefix_cache_hit_rate"] > 0  # the shared 16-token prefix is one whole block
    assert data["workload"]["input_len"] == [8, 24] and data["workload"]["prefix_len"] == 16
    # the step timer covers the timed run only: each request's first token comes from its prefill, the
    # other 3 from decode steps (the warm-up's request would add 3 more)
    steps = data["step_timer"]
    assert steps["decode"]["tokens"] == 6 * 3
    assert 0 < steps["prefill"]["tokens"] <= data["input_tokens"]
    assert {"schedule_ms", "prepare_ms", "forward_ms", "wait_ms"} <= set(steps["decode"])


def test_bench_with_a_preset(tiny_model):
    preset = Path(__file__).resolve().parent.parent / "configs" / "bench-cpu-smoke.toml"
    result = runner.invoke(app, ["bench", "--config", str(preset), "--model", str(tiny_model), "--num-prompts", "3",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert data["num_requests"] == 3 and data["engine"]["num_kvcache_blocks"] == 64  # preset, then flag
    assert data["workload"]["input_len"] == [16, 48]


def test_bench_rejects_lengths_beyond_max_model_len(tiny_model):
    result = runner.invoke(app, ["bench", *engine_args(tiny_model), "--input-len", "200", "--output-len", "100"])
    assert result.exit_code == 2 and "max_model_len" in result.stderr


PROBE_KEYS = {"device", "device_name", "total_bytes", "budget_bytes", "weights_bytes", "activation_peak_bytes",
              "cuda_graph_bytes", "kv_bytes_per_token", "kv_bytes_per_block", "block_size", "num_blocks",
              "cache_tokens", "max_model_len", "max_concurrent_full_seqs", "dtype", "hint"}


def test_probe_memory_json(tiny_model):
    result = runner.invoke(app, ["probe-memory", *engine_args(tiny_model), "--load-format", "dummy", "--json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert set(data) >= PROBE_KEYS and data["num_blocks"] == 128 and data["cache_tokens"] == 128 * 16
    assert data["hint"] is None and data["weights_bytes"] > 0
    table = runner.invoke(app, ["probe-memory", *engine_args(tiny_model)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "KV bytes per block" in table.stdout


def test_probe_memory_says_what_to_change(tiny_model):
    result = runner.invoke(app, ["probe-memory", *engine_args(tiny_model, "--num-kvcache-blocks", "4"), "--json"])
    assert result.exit_code == 0, result.output
    assert "--num-kvcache-blocks to at least 16" in orjson.loads(result.stdout)["hint"]
    result = runner.invoke(app, ["probe-memory", "--model", str(tiny_model), "--device", "cpu",
                                 "--kv-cache-memory-gib", "0.000001", "--json"])
    assert result.exit_code == 1
    assert "kv_cache_memory_gib" in orjson.loads(result.stdout)["hint"].replace("-", "_")
