"""The fourth adversarial run (issue 44), its runtime side: the environment and the input as the process meets them.

A full disk at the lock file, IN that never ends or never breaks a line, a
full TMPDIR while stdin is copied, a hanging chat template, a low open-file
limit with -tp/-dp and the control segment that must not outlive a failed
start, token ids past 64 bits and a deep record's own id. The data-parallel
items (a stopped replica, a request that keeps killing replicas) are in
tests/test_data_parallel.py.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from llmcli.cli.io.records import parse_line
from llmcli.cli.io.source import RawLine
from llmcli.cli.usage_error import UsageError

from processes import REPO, env
from test_cli_reliability import command, lines_of, one_line_error, quick_input, run


# -- F28, and round 3's leftover: what a record's error line says ------------------------------------
def test_token_ids_past_64_bits_are_named_as_such():
    rec = parse_line(RawLine(1, b'{"id": "big", "prompt_token_ids": [5, 18446744073709551616]}'))
    assert rec.error.field == "prompt_token_ids"
    assert "item 1 must be a non-negative integer, got an integer too large for 64 bits" in rec.error.message


@pytest.mark.parametrize("openai", [False, True])
def test_a_record_nested_too_deep_keeps_its_own_id(openai):
    deep = b'{"a": ' * 200 + b"1" + b"}" * 200
    line = (b'{"custom_id": "deep-one", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", '
            b'"extra": ' + deep + b"}}") if openai else b'{"id": "deep-one", "prompt": "x", "extra": ' + deep + b"}"
    rec = parse_line(RawLine(7, line))
    assert rec.out_id == "deep-one" and "nested more than 128 levels" in rec.error.message
    assert rec.error.field == ("body" if openai else "extra")


# -- F16: a full disk at start -----------------------------------------------------------------------
def test_a_lock_file_that_cannot_be_written_is_one_line_and_left_no_trace(tmp_path):
    from llmcli.cli.io.lock import OutputLock, OutputLocked, lock_path

    out = tmp_path / "out.jsonl"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # the pid's first byte fails, as on a full disk
    try:
        with pytest.raises(OutputLocked, match=r"cannot start OUT .*out.jsonl: writing the lock file .* failed"):
            OutputLock(str(out)).acquire()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not lock_path(out).exists() and not out.exists()  # no empty lock file left behind


# -- F17: IN that never ends, or never breaks a line -----------------------------------------------
def test_an_endless_device_as_in_is_one_line(tmp_path):
    err = one_line_error(run("/dev/urandom", "-o", str(tmp_path / "out.jsonl"), timeout=120), 2,
                         "IN /dev/urandom is a character device")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.jsonl").exists()


def test_a_line_past_the_limit_is_refused_naming_it(tmp_path, monkeypatch):
    from llmcli.cli.io import source

    from llmcli.cli.io.source import InputFile

    monkeypatch.setattr(source, "MAX_LINE_BYTES", 1 << 20)
    path = tmp_path / "array.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n[' + b"1," * (1 << 20) + b"1]\n")
    with pytest.raises(UsageError, match=r"array.jsonl:2: line longer than 1 MiB"):
        list(InputFile(str(path)).lines())
    with pytest.raises(UsageError, match="/dev/zero is a character device"):
        InputFile("/dev/zero")
    assert list(InputFile(os.devnull).lines()) == []  # /dev/null stays an empty input


# -- F25: a full TMPDIR while stdin is copied --------------------------------------------------------
def test_a_full_tmpdir_while_copying_stdin_is_named(tmp_path):
    data = b"".join(orjson.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2}) + b"\n" for _ in range(6000))
    limit = 1 << 16  # files past 64 KiB cannot grow: the copy of stdin fails as on a full TMPDIR
    result = subprocess.run(command("-", "-o", str(tmp_path / "out.jsonl")), input=data, env=env(),
                            capture_output=True, timeout=120,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    err = one_line_error(result, 2, "copying the input to a temporary file in", "set TMPDIR")
    assert "stdin cannot be read" not in err


# -- F6: a chat template that never finishes -------------------------------------------------------
SLOW_TEMPLATE = ("{% if messages[0].content == 'slow' %}{% for i in range(99999) %}{% for j in range(99999) %}"
                 "{% endfor %}{% endfor %}{% endif %}<|im_start|>user\n{{ messages[0].content }}<|im_end|>\n"
                 "<|im_start|>assistant\n")


def test_a_chat_template_that_hangs_is_that_records_error(tmp_path):
    template = tmp_path / "slow.jinja"
    template.write_text(SLOW_TEMPLATE)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"".join(orjson.dumps({"id": name, "messages": [{"role": "user", "content": name}],
                                           "max_tokens": 2}) + b"\n" for name in ("fast", "slow", "quick")))
    started = time.monotonic()
    result = run(str(inp), "-o", str(out), "--chat-template", str(template), "--on-error", "skip", "-q",
                 env={**env(), "LLMCLI_TEMPLATE_TIMEOUT_S": "0.5"}, timeout=120)
    assert result.returncode == 1, result.stderr.decode()
    got = {line["id"]: line for line in lines_of(out)}
    assert got["slow"]["error"]["message"] == "the chat template did not finish within 0.5 s (LLMCLI_TEMPLATE_TIMEOUT_S)"
    assert got["slow"]["error"]["field"] == "messages" and "text" in got["fast"] and "text" in got["quick"]
    assert time.monotonic() - started < 60


def test_a_time_limit_interrupts_only_what_overruns():
    from llmcli.cli.io.time_limit import TimeLimitExceeded, time_limit

    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.2):
            while True:
                pass
    assert time.monotonic() - started < 2
    for _ in range(1000):  # in time: nothing fires later, in this thread or elsewhere
        with time_limit(5):
            sum(range(50))
    time.sleep(0.1)


# -- F5: open files for -tp / -dp, and the control segment of a start that failed -------------------
def test_too_few_open_files_for_tensor_parallelism_is_one_line(tmp_path):
    result = subprocess.run(command(str(quick_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "out.jsonl"),
                                    "-tp", "2"), env=env(), capture_output=True, timeout=120,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24)))
    one_line_error(result, 2, "-tp 2 needs about", "open files", "ulimit -n")
    assert not (tmp_path / "out.jsonl").exists()


SEGMENT_SCRIPT = """
import os, sys, multiprocessing
from llmcli.parallel.shm_channel import ControlChannel, SHM_PREFIX
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
for _ in range(int(sys.argv[1])):
    os.close(fds.pop())  # this many descriptors left: the segment, its mapping, then the events run out
try:
    ControlChannel.create(multiprocessing.get_context("spawn"), 2, 1 << 16).unlink()
except OSError:
    pass
for fd in fds:
    os.close(fd)
print(len([n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{os.getpid()}_")]))
"""


@pytest.mark.parametrize("free", [2, 3])
def test_a_control_segment_is_not_left_behind_when_its_channel_fails(free):
    result = subprocess.run([sys.executable, "-c", SEGMENT_SCRIPT, str(free)], env=env(), capture_output=True,
                            timeout=60, cwd=REPO)
    assert result.stdout.decode().split() == ["0"], result.stderr.decode()


# -- F18: -tp 2, Ctrl-C twice while the engine starts --------------------------------------------
def test_two_ctrl_c_while_tensor_parallel_ranks_start_exit_130_leaving_nothing(tmp_path):
    import signal

    from processes import child_processes, wait_gone

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(str(quick_input(tmp_path / "in.jsonl")), "-o", str(out), "-tp", "2"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal has it
    try:
        deadline = time.monotonic() + 120
        while not (workers := [pid for pid, _, cmd in child_processes(proc.pid) if "spawn_main" in cmd]):
            assert proc.poll() is None and time.monotonic() < deadline, "no tensor-parallel worker started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)  # the second one stops the start-up where it is
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert "terminate called" not in err and "Traceback" not in err, err
    assert not wait_gone(workers), "a tensor-parallel worker outlived the run"
    assert not list(Path("/dev/shm").glob(f"llmcli_tp_{proc.pid}_*")) and not out.exists()
