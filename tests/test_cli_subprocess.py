"""The llmcli command line as a real process: pipes, SIGKILL then --resume, and Ctrl-C (SIGINT)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from processes import env, wait_for_lines

NUM_RECORDS = 96  # ~48 rounds: a loaded machine must not finish them all between the first line and the signal
MAX_TOKENS = 24


def command(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "llmcli", "generate", *args, "--model", str(model), "--device", "cpu",
            "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-num-seqs", "2"]


def slow_input(tmp_path: Path) -> Path:
    """Enough work (rounds of 2 sequences x 24 steps) that a kill after the first line is mid-way."""
    lines = [orjson.dumps({"prompt_token_ids": [3 + i, 40 + i, 7, 99], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                           "temperature": 0}) for i in range(NUM_RECORDS)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def whole_lines(out: Path) -> list[dict]:
    data = out.read_bytes()
    assert data.endswith(b"\n"), f"torn last line: {data[-80:]!r}"
    return [orjson.loads(line) for line in data.splitlines()]


def resume_and_check(tiny_model: Path, inp: Path, out: Path, done_before: int) -> None:
    result = subprocess.run(command(tiny_model, str(inp), "-o", str(out), "--resume"), env=env(),
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    lines = whole_lines(out)
    assert sorted(line["id"] for line in lines) == list(range(NUM_RECORDS))  # each input exactly once
    assert all(line["usage"]["completion_tokens"] == MAX_TOKENS and line["finish_reason"] == "length" for line in lines)
    assert f"{NUM_RECORDS - done_before} records to run" in result.stderr.decode()


def test_pipe_stdin_to_stdout_through_jq_like_filter(tiny_model, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"prompt": "The quick brown fox", "id": "a"}\n{"prompt_token_ids": [1, 2, 3]}\n')
    args = " ".join(command(tiny_model, "-", "-o", "-", "--max-tokens", "3", "--progress"))
    consumer = f"{sys.executable} -c \"import sys, json; [print(json.loads(l)['id']) for l in sys.stdin]\""
    result = subprocess.run(f"cat {inp} | {args} | {consumer}", shell=True, env=env(), capture_output=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["a", "1"]  # stdout carried nothing but the JSONL records
    assert b"requests answered" in result.stderr


def test_sigkill_leaves_whole_lines_and_resume_completes(tiny_model, tmp_path):
    inp, out = slow_input(tmp_path), tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(tiny_model, str(inp), "-o", str(out), "-q"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_lines(proc, out, 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    done = whole_lines(out)
    assert 1 <= len(done) < NUM_RECORDS, "the kill should land mid-way"
    resume_and_check(tiny_model, inp, out, len(done))


def test_sigint_flushes_and_exits_130(tiny_model, tmp_path):
    inp, out = slow_input(tmp_path), tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(tiny_model, str(inp), "-o", str(out), "--unordered"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_lines(proc, out, 1)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGINT did not stop the run")
    stderr = proc.stderr.read().decode()
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr
    done = whole_lines(out)
    assert 1 <= len(done) < NUM_RECORDS
    resume_and_check(tiny_model, inp, out, len(done))
