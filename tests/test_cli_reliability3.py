"""The failures of the third adversarial run (issue 32), each as a real `llmcli generate` process where it can be.

Side files written through planted links, one OUT under two names (hard links),
OUT paths that fail after loading; then inputs that used to crash or block a
run, bad settings, and messages that misled.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from processes import env, wait_for_lines
from test_cli_reliability import command, lines_of, one_line_error, quick_input, run, slow_input

VICTIM = b"someone else's file\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


# -- 1: a link planted at a side file's name is never written through -------------------------------
def test_a_link_at_the_lock_file_is_refused_and_its_target_kept(tmp_path):
    inp, out, target = quick_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", victim(tmp_path)
    os.symlink(target, tmp_path / "out.jsonl.llmcli-lock")
    one_line_error(run(str(inp), "-o", str(out), "-q", timeout=60), 2, "symbolic link", "out.jsonl.llmcli-lock")
    assert target.read_bytes() == VICTIM and not out.exists()


def test_a_link_at_the_fingerprint_or_its_temporary_is_not_written_through(tmp_path):
    inp, out, target = quick_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", victim(tmp_path)
    os.symlink(target, tmp_path / "out.jsonl.llmcli-input")
    one_line_error(run(str(inp), "-o", str(out), "-q", timeout=60), 2, "symbolic link", "out.jsonl.llmcli-input")
    os.unlink(tmp_path / "out.jsonl.llmcli-input")
    # The temporary's name used to be OUT.llmcli-input.<pid>.tmp: plant it for the very process that runs.
    plant = ("import os, sys; from llmcli.cli.app import main; "
             f"os.symlink({str(target)!r}, {str(out)!r} + '.llmcli-input.%d.tmp' % os.getpid()); "
             "sys.argv[0] = 'llmcli'; main()")
    argv = command(str(inp), "-o", str(out), "-q")
    result = subprocess.run([sys.executable, "-c", plant, *argv[3:]], env=env(), capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert target.read_bytes() == VICTIM and len(lines_of(out)) == 4
    assert b"xxh3_128" in (tmp_path / "out.jsonl.llmcli-input").read_bytes()


# -- 2: one OUT under two names is one lock ---------------------------------------------------------
def test_a_hard_link_of_a_running_out_is_refused(tmp_path):
    inp, out, alias = slow_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", tmp_path / "alias.jsonl"
    out.touch()
    os.link(out, alias)
    first = subprocess.Popen(command(str(inp), "-o", str(out), "-q"), env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        wait_for_lines(first, out, 1)
        first.send_signal(signal.SIGSTOP)
        try:
            second = run(str(inp), "-o", str(alias), "-q", "--resume", timeout=60)
            one_line_error(second, 2, "another llmcli", "hard link")
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read().decode()
    finally:
        first.kill()
    assert sorted(line["id"] for line in lines_of(out)) == list(range(16))  # each input once


def test_an_out_created_by_a_run_is_locked_under_its_other_names(tmp_path):
    from llmcli.cli.io.lock import OutputLock, OutputLocked

    out, alias = tmp_path / "out.jsonl", tmp_path / "alias.jsonl"
    first = OutputLock(str(out)).acquire()  # OUT does not exist yet: only the lock file is locked
    try:
        out.touch()  # what the run does once the input is checked
        first.lock_output()
        os.link(out, alias)
        with pytest.raises(OutputLocked, match="hard link"):
            OutputLock(str(alias)).acquire()
    finally:
        first.release()
    OutputLock(str(alias)).acquire().release()  # free again once the first run ends
    assert not (tmp_path / "alias.jsonl.llmcli-lock").exists()


# -- 10: OUT paths that used to fail after loading --------------------------------------------------
def test_out_paths_that_cannot_work_are_refused_before_loading(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl")
    dangling = tmp_path / "dangling.jsonl"
    os.symlink(tmp_path / "missing" / "out.jsonl", dangling)
    one_line_error(run(str(inp), "-o", str(dangling), "-q", timeout=60), 2, "folder", "does not exist")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.llmcli-input").mkdir()
    one_line_error(run(str(inp), "-o", str(out), "-q", timeout=60), 2, "out.jsonl.llmcli-input", "a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.jsonl", "in.jsonl", "out.jsonl.llmcli-input"]


# -- 3: n is linear in time, and bounded ------------------------------------------------------------
class _AllAtOnce:
    """An engine that finishes every queued completion in its next step (the Runner is what is timed)."""

    def __init__(self) -> None:
        self.queued: list = []
        self.stats = None

    def check_fits(self, ids, params) -> None:
        pass

    def add_request(self, ids, params, request_id) -> None:
        self.queued.append((ids, request_id))

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def step(self) -> list:
        from llmcli.engine.outputs import CompletionOutput, RequestOutput

        done, self.queued = self.queued, []
        return [RequestOutput(rid, None, ids, [CompletionOutput(0, "x", [1], "length")]) for ids, rid in done]


class _Sink:
    def __init__(self) -> None:
        self.lines: list = []

    def put(self, position, make, outputs=None) -> None:
        self.lines.append(make())

    def drain(self) -> None:
        pass

    def __getattr__(self, name):  # progress: advance, update, finish, revise_budget
        return lambda *args, **kwargs: None


def test_a_record_of_many_completions_is_collected_in_linear_time():
    import time

    from llmcli.cli.io.prepare import PreparedRequest
    from llmcli.cli.io.records import parse_line
    from llmcli.cli.io.source import RawLine
    from llmcli.cli.runner import Runner, StopFlag
    from llmcli.sampling_params import SamplingParams

    n = 20000  # the quadratic collection took minutes here (n=20,000: ~110 s in the adversarial run)
    rec = parse_line(RawLine(1, b'{"prompt_token_ids": [5, 6], "n": 2}'))
    item = PreparedRequest(rec, [5, 6], [SamplingParams(max_tokens=4)] * n)
    sink = _Sink()
    runner = Runner(_AllAtOnce(), sink, sink, model="m", include_token_ids=False, window=n, stop=StopFlag(),
                    max_model_len=64)
    started = time.perf_counter()
    counts = runner.run(iter([(0, item)]))
    assert time.perf_counter() - started < 10
    assert counts.answered == 1 and len(sink.lines[0]["choices"]) == n


def test_n_past_its_limit_and_integers_past_64_bits_are_that_records_errors(tmp_path):
    from llmcli.sampling_params import INT64_MAX, MAX_N

    good = {"prompt_token_ids": [5, 17, 42], "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    bad = [{"n": MAX_N + 1}, {"n": 10_000_000}, {"seed": INT64_MAX + 1}, {"seed": INT64_MAX, "n": 2},
           {"top_k": 2**63}, {"max_tokens": 2**63}, {"seed": 2**70}]
    inp = tmp_path / "in.jsonl"
    lines = [json_line({**good, **b}) for b in bad] + [json_line(good)]
    lines.append(b'{"custom_id": "o", "url": "/v1/completions", "body": {"prompt": [5, 6], "max_tokens": 2, '
                 b'"seed": 123456789012345678901234567890}}')
    inp.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    refused = run(str(inp), "-o", str(out), timeout=60)
    err = one_line_error(refused, 2, "in.jsonl:1: n: must be an integer from 1 to", "in.jsonl:3: seed:",
                         "in.jsonl:5: top_k:", "in.jsonl:6: max_tokens:", "in.jsonl:9: body.seed:")
    assert "an integer too large for 64 bits" in err and "1.2345678901234568e+29" not in err.split("too large")[0]
    assert not out.exists()
    result = run(str(inp), "-o", str(out), "-q", "--on-error", "skip", timeout=120)
    assert result.returncode == 1, result.stderr.decode()
    got = lines_of(out)
    assert [("error" in line) or line.get("response", {}).get("status_code", 200) >= 400 for line in got] == \
        [True] * len(bad) + [False, True]
    again = run(str(inp), "-o", str(out), "-q", "--on-error", "skip", "--resume", timeout=120)
    assert again.returncode == 1 and "Traceback" not in again.stderr.decode() and len(lines_of(out)) == len(got)


@pytest.mark.parametrize("flag", [["--seed", str(2**63)], ["--top-k", str(2**63)], ["--n", "99999"]])
def test_integer_flags_out_of_range_are_one_line(tmp_path, flag):
    result = cli(["generate", str(quick_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "out.jsonl"),
                  *command("")[5:], *flag])
    assert result.exit_code == 2 and f"error: {flag[0]} must be" in result.stderr and "from" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def cli(args: list[str], **kwargs):
    """The command in this process (start-up and the flag checks need no subprocess)."""
    from typer.testing import CliRunner

    from llmcli.cli.app import app

    return CliRunner().invoke(app, args, **kwargs)


def json_line(obj: dict) -> bytes:
    import json

    return json.dumps(obj).encode()  # orjson refuses to write integers past 64 bits


# -- 14: extreme but valid sampling values behave as their limits, or are refused with the range -----
def test_a_tiny_temperature_or_top_p_gives_the_greedy_tokens(tmp_path):
    import orjson

    base = {"prompt_token_ids": [5, 17, 42], "max_tokens": 6, "ignore_eos": True}
    cases = [{"temperature": 0}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300, "seed": 3},
             {"temperature": 1e-300}]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(orjson.dumps({**base, **c}) + b"\n" for c in cases))
    out = tmp_path / "out.jsonl"
    result = run(str(inp), "-o", str(out), "-q", "--include-token-ids", timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    greedy, *others = [line["token_ids"] for line in lines_of(out)]
    assert len(greedy) == 6 and others == [greedy] * len(others)
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(orjson.dumps({**base, "temperature": 1e39}) + b"\n")
    one_line_error(run(str(huge), "-o", str(tmp_path / "huge.out"), timeout=60), 2,
                   "huge.jsonl:1: temperature: must be from 0 to 10000")


# -- 6: a constraint that fails at compile time is that record's error -------------------------------
def test_a_constraint_failing_to_compile_is_that_records_error(tmp_path):
    import orjson

    base = {"max_tokens": 3, "temperature": 0}
    records = [{"prompt": "a", **base, "guided_grammar": "start: <[99999999]>"},  # passes the tokenizer-free check
               {"prompt": "b", **base},
               {"prompt": "c", **base, "guided_choice": [f"c{i}" for i in range(70_000)]}]  # llguidance panicked
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    out = tmp_path / "out.jsonl"
    result = run(str(inp), "-o", str(out), "--on-error", "skip", timeout=120)
    err = one_line_error(result, 1, "in.jsonl:3: guided_choice: ", "at most 16384", "in.jsonl:1: guided_grammar: ")
    assert "failed to compile" in err
    got = lines_of(out)
    assert [line["id"] for line in got] == [0, 1, 2] and "error" in got[0] and "error" in got[2]
    assert got[0]["error"]["field"] == "guided_grammar" and got[1]["finish_reason"] == "length"
    again = run(str(inp), "-o", str(out), "-q", "--on-error", "skip", "--resume", timeout=120)
    assert again.returncode == 1 and "Traceback" not in again.stderr.decode() and len(lines_of(out)) == 3


# -- 8: IN that is a pipe but not -, and - with stdin closed -----------------------------------------
def test_a_fifo_as_in_is_read_like_stdin_and_a_closed_stdin_is_one_line(tmp_path):
    import threading

    fifo, out = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    data = quick_input(tmp_path / "in.jsonl").read_bytes()
    feeder = threading.Thread(target=lambda: fifo.write_bytes(data), daemon=True)
    feeder.start()
    result = run(str(fifo), "-o", str(out), "-q", timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert [line["id"] for line in lines_of(out)] == [0, 1, 2, 3]
    closed = [sys.executable, "-c", "import os, sys; os.close(0); os.execv(sys.executable, sys.argv[1:])",
              *command("-", "-o", str(tmp_path / "closed.jsonl"))]
    result = subprocess.run(closed, env=env(), capture_output=True, timeout=60)
    one_line_error(result, 2, "stdin is closed")


# -- 9, 15: --config and --chat-template read as text, TOML values typed as the flags are -------------
def test_config_files_in_utf16_or_with_wrong_types_or_bad_bytes(tmp_path):
    inp, out = quick_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["generate", str(inp), "-o", str(out), *command("")[5:]]
    typed = tmp_path / "typed.toml"
    typed.write_text("max-tokens = true\n")
    result = cli([*args, "--config", str(typed)])
    assert result.exit_code == 2 and "max-tokens must be an integer, got true" in " ".join(result.stderr.split())
    utf16 = tmp_path / "utf16.toml"
    utf16.write_bytes("quiet = true\nmax-tokens = 1\n".encode("utf-16"))  # with its byte-order mark
    result = cli([*args, "--config", str(utf16)])
    assert result.exit_code == 0, result.stderr
    assert [line["usage"]["completion_tokens"] for line in lines_of(out)] == [2, 2, 2, 2]  # records set 2
    template = tmp_path / "template.jinja"
    template.write_bytes(b"{{ messages[0]['content'] }}\xff")
    result = cli([*args, "--chat-template", str(template), "--overwrite"])
    assert result.exit_code == 2 and "not UTF-8 text" in result.stderr and "Traceback" not in result.stderr


# -- 11: engine sizes out of range are one line, before or (KV pool) right after loading --------------
@pytest.mark.parametrize("flag, words", [
    (["--max-num-seqs", "99999999999999999999999"], "--max-num-seqs must be an integer from 1 to"),
    (["--num-kvcache-blocks", "99999999999999999999"], "--num-kvcache-blocks must be an integer from 1 to"),
    (["--kvcache-block-size", "99999999999"], "--kvcache-block-size must be an integer from 1 to"),
    (["--kv-cache-memory-gib", "1e30"], "--kv-cache-memory-gib must be a positive number of GiB, at most"),
    (["--kv-cache-memory-gib", "100000"], "of memory; ask for less"),
    (["--kv-cache-memory-gib", "0.000000001"], "the KV cache does not fit: no KV block fits"),
])
def test_engine_sizes_out_of_range_are_one_line(tmp_path, flag, words):
    base = [a for a in command("")[5:]]
    cut = base.index("--num-kvcache-blocks")
    base = base[:cut] + base[cut + 2:]  # the flag under test sizes the pool
    result = cli(["generate", str(quick_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "out.jsonl"),
                  *base, *flag])
    assert result.exit_code == 2 and words in " ".join(result.stderr.split()), result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "out.jsonl").exists()


# -- 4, 7: what a conversation renders is measured first; deep nesting is an input error ---------------
def test_huge_roles_many_messages_and_deep_nesting_are_refused_before_rendering(tmp_path):
    import time

    import orjson

    deep: dict = {}
    node = deep
    for _ in range(300):  # past orjson's 254 levels: the fingerprint crashed
        node["a"] = {}
        node = node["a"]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join([
        orjson.dumps({"messages": [{"role": "r" * 20_000_000, "content": "hi"}]}),
        orjson.dumps({"messages": [{"role": "user", "content": ""}] * 300_000}),
        b'{"messages": [{"role": "user", "content": "x", "extra": ' + b'{"a": ' * 300 + b'1' + b'}' * 300 + b'}]}',
        b'{"prompt": "x", "guided_json": ' + b'{"items": ' * 200 + b'{}' + b'}' * 200 + b'}',
        b'{"prompt": "caf\xe9"}',
    ]) + b"\n")
    started = time.monotonic()
    result = run(str(inp), "-o", str(tmp_path / "out.jsonl"), timeout=120)
    err = one_line_error(result, 2, "in.jsonl:1: messages: the conversation's strings are",
                         "in.jsonl:2: messages: holds 300000 messages", "in.jsonl:3: messages: is nested more than",
                         "in.jsonl:4: guided_json: is nested more than", "in.jsonl:5: not valid UTF-8 (byte 16")
    assert "surrogates" not in err
    assert time.monotonic() - started < 60  # rendering and tokenizing them took 31-40 s each


# -- 13: bad LLMCLI_* values are one line naming the variable, before anything starts -----------------
@pytest.mark.parametrize("name, value", [("LLMCLI_CHECK_AHEAD", "abc"), ("LLMCLI_MASK_THREADS", "abc"),
                                         ("LLMCLI_TP_HEARTBEAT_S", "abc"), ("LLMCLI_TP_SHM_MIB", "0"),
                                         ("LLMCLI_DP_START_TIMEOUT_S", "abc")])
def test_bad_environment_values_are_one_line(tmp_path, name, value):
    result = cli(["generate", str(quick_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "out.jsonl"),
                  *command("")[5:]], env={name: value})
    assert result.exit_code == 2 and f"error: environment variable {name}={value!r}: must be" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


# -- 12: bench and probe-memory check where the result goes first, and never lose it to a failed write ---
def test_bench_checks_its_destination_first_and_keeps_a_result_it_cannot_write(tmp_path):
    bench = ["bench", *command("")[5:], "--load-format", "dummy", "--num-prompts", "2", "--input-len", "4",
             "--output-len", "2", "--warmup", "0"]
    result = cli([*bench, "--output", str(tmp_path / "missing" / "x.json")])
    assert result.exit_code == 2 and "does not exist" in result.stderr and "bench:" not in result.stderr
    result = cli([*bench, "--seed", str(10**20)])
    assert result.exit_code == 2 and "--seed must be an integer from 0 to" in result.stderr
    result = cli([*bench, "--output", "/dev/full"])
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    assert '"output_tokens":4' in result.stderr  # the result itself, on stderr


# -- messages that misled ------------------------------------------------------------------------------
def test_messages_name_the_field_and_the_record(tmp_path):
    import orjson

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(orjson.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}}) + b"\n"
        + orjson.dumps({"prompt": "x", "max_tokens": 0}) + b"\n")
    args = ["generate", str(inp), "-o", str(tmp_path / "out.jsonl"), *command("")[5:]]
    result = cli(args)
    assert result.exit_code == 2 and "in.jsonl:1: body.top_logprobs: must be an integer from 0 to 20" in result.stderr
    assert "in.jsonl:2: max_tokens:" in result.stderr and "None" not in result.stderr
    result = cli([*args, "--max-errors", "-1"])
    assert result.exit_code == 2 and "--max-errors must be at least 0" in result.stderr


def test_an_aborted_constrained_request_is_named_by_its_line():
    from llmcli.cli.runner import Runner, StopFlag
    from llmcli.cli.io.prepare import PreparedRequest
    from llmcli.cli.io.records import parse_line
    from llmcli.cli.io.source import RawLine
    from llmcli.sampling_params import SamplingParams

    engine, sink = _AllAtOnce(), _Sink()
    rec = parse_line(RawLine(7, b'{"prompt_token_ids": [5, 6], "n": 2}'))
    runner = Runner(engine, sink, sink, model="m", include_token_ids=False, window=8, stop=StopFlag(),
                    max_model_len=64)
    runner._admit(iter([(0, PreparedRequest(rec, [5, 6], [SamplingParams(max_tokens=2)] * 2))]))
    assert [rid for _, rid in engine.queued] == ["line 7 completion 0", "line 7 completion 1"]  # not '0.0'


# -- 16: the local Ray cluster goes down with a SIGKILLed driver ---------------------------------------
def _ray_agents() -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/cmdline").read_bytes().startswith(
                    (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")):
                found.add(int(entry))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_ray_agents_do_not_outlive_a_killed_driver(tmp_path):
    import time

    pytest.importorskip("ray")
    before = _ray_agents()
    inp, out = slow_input(tmp_path / "in.jsonl", n=64), tmp_path / "out.jsonl"
    driver = subprocess.Popen(command(str(inp), "-o", str(out), "-q", "--distributed-backend", "ray"), env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_lines(driver, out, 1, timeout=200)
        assert _ray_agents() - before, "no Ray agents were started: nothing to check"
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 20  # they lingered 45-90 s
        while _ray_agents() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ray_agents() - before, "Ray agents outlived the killed driver"
    finally:
        driver.kill()
