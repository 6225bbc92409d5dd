"""What a vLLM / OpenAI-batch user meets at the command line: field names, the thinking switch, help and
flag errors, progress frames, output record extras, probe-memory on CPU (issue 15, items 3 and 6-10)."""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmcli.cli.app import app
from llmcli.cli.flag_errors import flag_message
from llmcli.cli.io.fields import UnknownFieldReport
from llmcli.cli.io.output import result_record
from llmcli.cli.io.prepare import Preparer
from llmcli.cli.io.reasoning import choose_parser, split_qwen3
from llmcli.cli.io.records import parse_line
from llmcli.cli.io.source import RawLine
from llmcli.cli.probe import render
from llmcli.cli.progress import ProgressState, frame
from llmcli.engine.outputs import MemoryReport, RequestOutput
from llmcli.models.hub import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import env  # noqa: E402
from tiny_qwen3 import CHAT_TEMPLATE, THINK_CHAT_TEMPLATE  # noqa: E402

runner = CliRunner()
HI = [{"role": "user", "content": "hi"}]


def rec_of(obj, number: int = 1):
    return parse_line(RawLine(number, orjson.dumps(obj)))


def engine_args(model: Path) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--num-kvcache-blocks", "64", "--block-size", "16",
            "--max-num-seqs", "4", "--max-model-len", "256"]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def lines_of(text: str) -> list[dict]:
    return [orjson.loads(line) for line in text.splitlines()]


# -- item 6: aliases and unknown fields -------------------------------------------------
def test_aliases_map_onto_llmcli_fields():
    r = rec_of({"prompt": "a", "max_new_tokens": 4, "stop_sequences": ["x"]})
    assert r.error is None and r.sampling == {"max_tokens": 4, "stop": ["x"]} and r.unknown == []
    r = rec_of({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "max_completion_tokens": 7}})
    assert r.error is None and r.sampling == {"max_tokens": 7}
    r = rec_of({"prompt": "a", "max_new_tokens": 4, "max_tokens": 5})
    assert r.error.field == "max_new_tokens" and "max_tokens" in r.error.message


def test_unknown_fields_are_listed_with_their_place():
    r = rec_of({"prompt": "a", "foo": 1, "temprature": 0})
    assert r.error is None and r.unknown == ["foo", "temprature"]
    r = rec_of({"custom_id": "c", "url": "/v1/chat/completions", "extra": 1,
                "body": {"model": "m", "messages": HI, "user": "u", "frob": 1}})
    assert r.error is None and r.unknown == ["extra", "body.frob"]  # OpenAI's user is metadata: known


def test_unknown_field_warning_is_one_line_per_name():
    report = UnknownFieldReport()
    for line in (3, 7, 9, 12, 15):
        report.add("foo", line)
    report.add("temprature", 4, "temperature")
    assert report.messages("prompts.jsonl") == [
        'prompts.jsonl: unknown field "foo" on lines 3, 7, 9 (and 2 more); ignored',
        'prompts.jsonl: unknown field "temprature" on line 4; ignored (did you mean "temperature"?)',
    ]


def test_config_tables_are_checked_for_every_command(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    toml = tmp_path / "run.toml"
    toml.write_text('[bnech]\nnum-prompts = 3\n')
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--config", str(toml)])
    assert result.exit_code == 2 and "unknown table [bnech]" in result.output
    toml.write_text('[bench]\nnum-promts = 3\n')
    result = runner.invoke(app, ["probe-memory", *engine_args(tiny_model), "--config", str(toml)])
    assert result.exit_code == 2 and "[bench]" in result.output and "num-promts" in result.output


# -- item 3: the thinking switch and the reasoning parser -------------------------------------
@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    ("I add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),  # <think> was in the prompt
    ("It is 4.", None, "It is 4."),  # thinking off: no tags at all
    ("<think>\nStill thinking about", "Still thinking about", ""),  # cut off by max_tokens while thinking
    ("<think></think>It is 4.", "", "It is 4."),
])
def test_qwen3_reasoning_split(text, reasoning, content):
    split = split_qwen3(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_reasoning_parser_auto_detection():
    assert choose_parser("auto", THINK_CHAT_TEMPLATE) == "qwen3"
    assert choose_parser("auto", CHAT_TEMPLATE) is None
    assert choose_parser("none", THINK_CHAT_TEMPLATE) is None
    assert choose_parser("qwen3", CHAT_TEMPLATE) == "qwen3"


def test_reasoning_in_output_records():
    out = RequestOutput.single("0.0", [1, 2], [5, 6, 7], "<think>\nplan\n</think>\n\nanswer", "stop")
    plain = result_record(rec_of({"messages": HI}), [out], model="m", reasoning="qwen3")
    assert (plain["reasoning"], plain["text"]) == ("plan", "answer")
    chat = rec_of({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": HI}})
    message = result_record(chat, [out], model="m", reasoning="qwen3")["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer", "reasoning": "plan"}
    assert "reasoning" not in result_record(rec_of({"messages": HI}), [out], model="m")


@pytest.fixture(scope="module")
def think_preparer(tiny_model):
    return Preparer(load_tokenizer(tiny_model), 256, 640, {}, chat_template=THINK_CHAT_TEMPLATE)


def test_chat_template_kwargs_reach_the_template(think_preparer):
    tok = think_preparer.tokenizer
    on = think_preparer.prepare(rec_of({"messages": HI}))
    off = think_preparer.prepare(rec_of({"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}))
    assert tok.decode(on.prompt_token_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(off.prompt_token_ids) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                                "<think>\n\n</think>\n\n")
    # the command line's kwargs apply to every record; a record's own keys win
    cli_off = Preparer(tok, 256, 640, {}, THINK_CHAT_TEMPLATE, template_kwargs={"enable_thinking": False})
    assert cli_off.prepare(rec_of({"messages": HI})).prompt_token_ids == off.prompt_token_ids
    rec = rec_of({"messages": HI, "chat_template_kwargs": {"enable_thinking": True}})
    assert cli_off.prepare(rec).prompt_token_ids == on.prompt_token_ids
    bad = rec_of({"messages": HI, "chat_template_kwargs": "no"})
    assert bad.error.field == "chat_template_kwargs"


def test_batched_rendering_equals_one_at_a_time(think_preparer):
    records = [rec_of({"messages": [{"role": "user", "content": f"question {i}"}],
                       **({"chat_template_kwargs": {"enable_thinking": False}} if i % 2 else {})}, i + 1)
               for i in range(6)] + [rec_of({"prompt": "plain text"}, 7)]
    batched = think_preparer.prepare_all(records)
    single = [think_preparer.prepare(rec_of(orjson.loads(orjson.dumps(_raw(r))), r.line)) for r in records]
    assert [b.prompt_token_ids for b in batched] == [s.prompt_token_ids for s in single]
    broken = Preparer(think_preparer.tokenizer, 256, 640, {},
                      chat_template="{{ messages[0]['content'] | nosuchfilter }}")
    out = broken.prepare_all([rec_of({"messages": HI}, 3)])
    assert out[0].error.line == 3 and "chat template" in out[0].error.message


def _raw(rec):
    if rec.kind == "messages":
        return {"messages": rec.prompt, **({"chat_template_kwargs": rec.chat_template_kwargs}
                                           if rec.chat_template_kwargs else {})}
    return {"prompt": rec.prompt}


def test_thinking_switch_end_to_end(tiny_model, tmp_path):
    template = tmp_path / "think.jinja"
    template.write_text(THINK_CHAT_TEMPLATE)
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "on", "messages": HI, "max_tokens": 2},
        {"id": "off", "messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    ])
    args = ["generate", str(inp), *engine_args(tiny_model), "--chat-template", str(template), "--include-token-ids"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    on, off = lines_of(result.stdout)
    tok = load_tokenizer(tiny_model)
    assert tok.decode(off["prompt_token_ids"]).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(on["prompt_token_ids"]).endswith("assistant\n")
    # auto: the template uses <think>, so every record says what it reasoned (nothing, for these outputs)
    assert "reasoning parser qwen3" in result.stderr
    assert "reasoning" in on and on["text"] == split_qwen3(tok.decode(on["token_ids"])).content
    result = runner.invoke(app, [*args, "--chat-template-kwargs", '{"enable_thinking": false}',
                                 "--reasoning-parser", "none"])
    first = lines_of(result.stdout)[0]
    assert first["prompt_token_ids"] == off["prompt_token_ids"] and "reasoning" not in first
    result = runner.invoke(app, [*args, "--chat-template-kwargs", "{enable_thinking: false}"])
    assert result.exit_code == 2 and "--chat-template-kwargs" in result.output


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny Qwen3 that, greedily, answers "<think>The capital of France</think>Paris." and then EOS.

    Its layers add nothing (o_proj and down_proj are zero), so each logit depends on the last token alone;
    the lm_head maps each token of that answer to the next (their embeddings made orthonormal), starting
    from the token ending the chat prompt. <think> and </think> are added tokens, as in Qwen3's tokenizer.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tiny_qwen3 import write_tiny_qwen3

    path = write_tiny_qwen3(tmp_path_factory.mktemp("thinking_qwen3"), num_hidden_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(path)
    rendered = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    start = tok.encode(rendered, add_special_tokens=False)[-1]  # the chat prompt's last token
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    chain = [start, think, *tok.encode("The capital of France", add_special_tokens=False), end,
             *tok.encode("Paris.", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(set(chain)) == len(chain), "a token repeats: the next token would not be unique"
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    basis = torch.linalg.qr(torch.randn(hidden, len(chain), generator=torch.Generator().manual_seed(0)))[0].T
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    for i, (token, following) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token] = basis[i] * hidden ** 0.5
        lm_head[following] = basis[i] * 10.0
    weights["lm_head.weight"] = lm_head
    weights["model.norm.weight"] = torch.ones(hidden)
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_reasoning_split_end_to_end(thinking_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "plain", "messages": HI, "temperature": 0, "max_tokens": 20},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": HI, "temperature": 0, "max_tokens": 20}},
    ])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(thinking_model), "-q",
                                 "--reasoning-parser", "qwen3"])
    assert result.exit_code == 0, result.output
    plain, chat = lines_of(result.stdout)
    assert (plain["reasoning"], plain["text"], plain["finish_reason"]) == (
        "The capital of France", "Paris.", "stop")
    message = chat["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning": "The capital of France"}
    # auto: this model's template has no <think>, so the text stays whole
    result = runner.invoke(app, ["generate", str(inp), *engine_args(thinking_model), "-q"])
    plain = lines_of(result.stdout)[0]
    assert plain["text"] == "<think>The capital of France</think>Paris." and "reasoning" not in plain


# -- item 6 end to end: warnings, --strict ------------------------------------------------
def test_unknown_fields_warn_or_fail_with_strict(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a", "max_new_tokens": 2, "foo": i} for i in range(5)])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert 'prompts.jsonl: unknown field "foo" on lines 1, 2, 3 (and 2 more); ignored' in result.stderr
    assert [r["usage"]["completion_tokens"] for r in lines_of(result.stdout)] == [2] * 5
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--strict"])
    assert result.exit_code == 2 and "prompts.jsonl:4: foo: unknown field" in result.stderr


# -- item 7: help and flag errors -----------------------------------------------------------
def test_help_speaks_the_cli():
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = result.stdout
    assert "<bool>" not in text and "Most sequences running at once. [default: 1024]" in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= 80
    wide = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).stdout
    assert "<auto|cuda|cpu>" in wide and "<auto|qwen3|harmony|none>" in wide and "<bool>" not in wide
    for alias in ("--block-size", "--num-gpu-blocks-override", "-i", "--output-file", "--engine-seed"):
        assert alias in wide
    assert runner.invoke(app, ["--version"]).stdout.startswith("llmcli ")


@pytest.mark.parametrize("message, expected", [
    ("SamplingParams.max_tokens: must be an integer >= 1, or None for 'until the context is full' (got 0)",
     "--max-tokens must be at least 1, got 0"),
    ("Config.max_num_seqs=0: must be a positive integer", "--max-num-seqs must be at least 1, got 0"),
    ("Config.seed=-1: must be an integer", "--engine-seed must be an integer, got -1"),
    ("SamplingParams.top_p: must be in (0, 1] (got 1.5)", "--top-p must be in (0, 1], got 1.5"),
    ("something else", "something else"),
])
def test_field_errors_name_the_flag(message, expected):
    assert flag_message(message) == expected


def test_flag_errors_from_the_command_line(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--max-tokens", "0"])
    assert result.exit_code == 2 and "error: --max-tokens must be at least 1, got 0" in result.stderr
    result = runner.invoke(app, ["generate", "-i", str(inp), *engine_args(tiny_model), "--max-num-seqs", "0"])
    assert result.exit_code == 2 and "error: --max-num-seqs must be at least 1, got 0" in result.stderr
    result = runner.invoke(app, ["generate", str(inp), "-i", str(inp), *engine_args(tiny_model)])
    assert result.exit_code == 2 and "-i/--input" in result.stderr


# -- item 8: progress frames ----------------------------------------------------------------
def render_frame(state: ProgressState, width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    console.print(frame(state))
    return [line.rstrip() for line in console.file.getvalue().splitlines()]


def test_progress_frame_fits_80_columns_and_counts_tokens():
    st = ProgressState(records_total=60, tokens_total=60 * 40, records_done=12, unused_tokens=100, generated=620,
                       prompt_done=1800, running=8, waiting=40, kv_usage=0.37, elapsed_s=10.0)
    lines = render_frame(st)
    assert len(lines) == 2 and all(len(line) <= 80 for line in lines)
    assert "30% 720/2.4k tok" in lines[0] and "0:00:10 eta 0:00:23" in lines[0]
    assert lines[1] == "req 12/60  prompt 180 tok/s  gen 62 tok/s  run 8  wait 40  KV 37%"
    big = ProgressState(records_total=123456, tokens_total=987654321, records_done=123455, generated=987000000,
                        prompt_done=10**9, running=512, waiting=99999, kv_usage=1.0, elapsed_s=3599.0)
    assert all(len(line) <= 80 for line in render_frame(big))


def test_progress_final_frame_is_consistent():
    st = ProgressState(records_total=3, tokens_total=30, records_done=3, unused_tokens=12, generated=18,
                       prompt_done=45, running=0, waiting=0, elapsed_s=2.0, finished=True)
    top, bottom = render_frame(st)
    assert "100% 30/30 tok" in top and top.endswith("0:00:02 done")
    assert bottom == "req 3/3  prompt 22 tok/s  gen 9 tok/s  run 0  wait 0  KV 0%"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_progress_in_a_real_terminal(tiny_model, tmp_path):
    """The run in an 80x24 tmux pane: the last frame says all finished, and nothing runs past column 80."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox {i}", "max_tokens": 3} for i in range(6)])
    done = tmp_path / "done"
    cmd = (f"{sys.executable} -m llmcli generate {inp} -o {tmp_path / 'out.jsonl'} "
           f"{' '.join(engine_args(tiny_model))} --ignore-eos; touch {done}; sleep 60")
    session = f"llmcli-test-{tmp_path.name}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True,
                   env=env(), cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                              check=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert done.exists(), pane
    lines = pane.splitlines()
    bar = next(i for i, line in enumerate(lines) if line.startswith("generate "))
    assert "100% 18/18 tok" in lines[bar] and lines[bar].rstrip().endswith("done")
    assert lines[bar + 1].startswith("req 6/6 ") and "run 0  wait 0" in lines[bar + 1]
    assert "requests answered" in pane and all(len(line) <= 80 for line in lines)


# -- item 9: output record extras ----------------------------------------------------------
def test_plain_records_with_totals_prompt_ids_and_metrics():
    out = RequestOutput.single("0.0", [1, 2, 3], [7, 8], "hi", "length", num_cached_prompt_tokens=2,
                        arrival_time=100.0, first_token_time=100.25, finish_time=101.5)
    line = result_record(rec_of({"prompt": "a", "id": "q"}), [out], model="m", include_token_ids=True,
                         include_metrics=True)
    assert line == {"id": "q", "text": "hi", "finish_reason": "length", "token_ids": [7, 8],
                    "metrics": {"time_to_first_token_s": 0.25, "total_time_s": 1.5, "cached_prompt_tokens": 2},
                    "prompt_token_ids": [1, 2, 3],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    two = result_record(rec_of({"prompt": "a"}), [out, out], model="m", include_metrics=True)
    assert [c["metrics"]["total_time_s"] for c in two["choices"]] == [1.5, 1.5]
    assert two["usage"]["total_tokens"] == 7


def test_include_metrics_end_to_end(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [5, 17, 42, 99], "max_tokens": 3}] * 2)
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--ignore-eos", "-q",
                                 "--include-metrics"])
    assert result.exit_code == 0, result.output
    first, second = lines_of(result.stdout)
    m = first["metrics"]
    assert 0 < m["time_to_first_token_s"] <= m["total_time_s"]
    assert first["usage"]["total_tokens"] == 7


# -- item 10: probe-memory on CPU ----------------------------------------------------------
def test_probe_memory_table_on_cpu():
    report = MemoryReport(device="cpu", device_name="cpu", total_bytes=8 << 30, budget_bytes=1 << 29,
                          weights_bytes=1 << 20, activation_peak_bytes=0, cuda_graph_bytes=0, other_bytes=0,
                          kv_bytes_per_token=512, kv_bytes_per_block=8192, block_size=16, num_blocks=4096,
                          cache_tokens=65536, max_model_len=2048, max_concurrent_full_seqs=32.0, dtype="float32")
    console = Console(file=io.StringIO(), width=100, color_system=None)
    render(report, None, console)
    text = console.file.getvalue()
    assert "llmcli probe-memory: CPU, float32" in text and "(cpu, float32)" not in text
    assert "KV-cache budget" in text and "budget for llmcli" not in text
    row = next(line for line in text.splitlines() if "activation peak" in line)
    assert "n/a" in row and "KiB" not in row
    row = next(line for line in text.splitlines() if "at once" in line)
    assert row.split("│")[2].strip() == "32"


def test_engine_defaults_in_help_are_configs():
    import dataclasses

    from llmcli.cli.options import ENGINE_KNOBS
    from llmcli.config import DEFAULT_KVCACHE_BLOCK_SIZE, Config

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for knob in ENGINE_KNOBS:
        real = defaults[knob.name]
        if isinstance(real, bool):
            assert knob.default == ("on" if real else "off"), knob.name
        elif isinstance(real, (int, float)):
            assert float(knob.default) == real, knob.name
        elif knob.name == "kvcache_block_size":  # None: the backend's size, stated as the usual one
            assert knob.default.split(";")[0] == str(DEFAULT_KVCACHE_BLOCK_SIZE), knob.default
        elif real is None:
            assert knob.default and not knob.default[0].isdigit(), knob.name  # said in words: derived
        else:
            assert knob.default.split(":")[0] == real, knob.name
            assert not knob.choices or real in knob.choices
