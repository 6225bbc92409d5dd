"""The failures of an adversarial run (issue 14), each as a real `llmcli generate` process on the tiny model.

Two runs on one OUT, reading a device or a FIFO for --resume, read-only OUT or
folder, a full disk, a closed stdout, NaN, emoji codes in messages, an implicit
id equal to an explicit one, a stopped tensor-parallel rank, IN as OUT and a
resume with another input; then the smaller ones (fsync of a pipe, a huge
prompt, --resume with --overwrite, resuming earlier error records, which field a
too-big request blames).
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest

from processes import REPO, child_processes, env, wait_for_lines, wait_gone

MODEL = REPO / "examples" / "tiny-qwen3"
NUM_RECORDS = 16
MAX_TOKENS = 24


def command(*args: str, blocks: int = 64) -> list[str]:
    return [sys.executable, "-m", "llmcli", "generate", *args, "--model", str(MODEL), "--device", "cpu",
            "--num-kvcache-blocks", str(blocks), "--kvcache-block-size", "16", "--max-num-seqs", "2",
            "--max-model-len", "256"]


def run(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), env=kwargs.pop("env", env()), capture_output=True, timeout=timeout,
                          **kwargs)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def slow_input(path: Path, n: int = NUM_RECORDS) -> Path:
    """Enough work (rounds of 2 sequences x 24 steps) that the run is still going when we look."""
    return write_jsonl(path, [{"prompt_token_ids": [3 + i, 40 + i, 7, 99], "max_tokens": MAX_TOKENS,
                               "ignore_eos": True, "temperature": 0} for i in range(n)])


def quick_input(path: Path, n: int = 4) -> Path:
    return write_jsonl(path, [{"prompt_token_ids": [5 + i, 17, 42], "max_tokens": 2, "ignore_eos": True,
                               "temperature": 0} for i in range(n)])


def lines_of(out: Path) -> list[dict]:
    data = out.read_bytes()
    assert not data or data.endswith(b"\n"), f"torn last line: {data[-80:]!r}"
    return [orjson.loads(line) for line in data.splitlines()]


def one_line_error(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    assert "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


# -- 1: two runs, one OUT --------------------------------------------------------------------------
def test_second_run_on_a_locked_out_exits_2_naming_the_first(tmp_path):
    inp, out = slow_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    first = subprocess.Popen(command(str(inp), "-o", str(out), "-q"), env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        wait_for_lines(first, out, 1)
        first.send_signal(signal.SIGSTOP)  # holds the lock, however slowly the second one starts
        try:
            for extra in (["--resume"], []):  # as the adversarial run did it, and plainly
                second = run(str(inp), "-o", str(out), "-q", *extra)
                one_line_error(second, 2, f"pid {first.pid}", "another llmcli")
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read().decode()
    finally:
        first.kill()
    assert sorted(line["id"] for line in lines_of(out)) == list(range(NUM_RECORDS))  # each input once
    assert not (tmp_path / "out.jsonl.llmcli-lock").exists()  # a run that ends removes its lock file
    again = run(str(inp), "-o", str(out), "-q", "--resume")  # and the lock is free again
    assert again.returncode == 0, again.stderr.decode()


def test_a_lock_file_left_by_a_killed_run_is_taken_over(tmp_path):
    inp, out = quick_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.llmcli-lock").write_text("999999999\n")  # what kill -9 leaves: the file, no lock
    result = run(str(inp), "-o", str(out), "-q")
    assert result.returncode == 0, result.stderr.decode()
    assert len(lines_of(out)) == 4 and not (tmp_path / "out.jsonl.llmcli-lock").exists()


def test_without_locks_on_the_filesystem_a_run_warns_and_goes_on(tmp_path, monkeypatch):
    import errno

    from llmcli.cli.io import lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    held = lock.OutputLock(str(tmp_path / "out.jsonl")).acquire()
    assert held.fd is None and "does not support locks" in held.warning and "No locks available" in held.warning
    held.release()


# -- 2: --resume on something that is not a regular file -------------------------------------------
@pytest.mark.parametrize("target", ["/dev/full", "fifo"])
def test_resume_refuses_a_device_or_pipe_at_once(tmp_path, target):
    if target == "fifo":
        target = str(tmp_path / "out.fifo")
        os.mkfifo(target)
    inp = quick_input(tmp_path / "in.jsonl")
    result = run(str(inp), "-o", target, "--resume", timeout=60)
    one_line_error(result, 2, "--resume needs OUT to be a regular file")


def test_resume_scan_memory_is_bounded_by_one_line(tmp_path):
    from llmcli.cli.io.resume import scan_output

    out = tmp_path / "out.jsonl"
    line = orjson.dumps({"id": 0, "text": "x" * 1000}) + b"\n"
    with open(out, "wb") as f:
        for _ in range(20):
            f.write(line * 1000)  # 20 MB, every line answering id 0
    tracemalloc.start()
    try:
        state = scan_output(out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert state.answered == {"id:0"} and state.num_lines == 20_000
    assert peak < 1 << 20, f"reading OUT took {peak / 2**20:.1f} MiB"


# -- 3: OUT or its folder not writable -----------------------------------------------------------
def unprivileged(cmd: list[str]) -> list[str]:
    """As root, drop the capabilities that bypass file permissions (else a read-only file is writable)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.fail("running as root needs setpriv (util-linux) to test permissions")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]


@pytest.mark.parametrize("case", ["read-only OUT --resume", "read-only OUT --overwrite", "read-only folder"])
def test_unwritable_out_is_refused_before_the_model_loads(tmp_path, case):
    inp = quick_input(tmp_path / "in.jsonl")
    folder = tmp_path / "outdir"
    folder.mkdir()
    out = folder / "out.jsonl"
    flags = []
    if case.startswith("read-only OUT"):
        out.write_bytes(b'{"id": 0, "text": "a"}\n{"id": 1, "te')  # a torn tail, which --resume would cut
        out.chmod(0o444)
        flags = ["--resume"] if "resume" in case else ["--overwrite"]
    else:
        folder.chmod(0o555)
    try:
        result = subprocess.run(unprivileged(command(str(inp), "-o", str(out), *flags)), env=env(),
                                capture_output=True, timeout=120)
    finally:
        folder.chmod(0o755)
    err = one_line_error(result, 2, "Permission denied", str(out))
    assert len(err.strip().splitlines()) == 1, err
    if case.startswith("read-only OUT"):
        assert out.read_bytes().endswith(b'"te')  # untouched


# -- 4: disk full ----------------------------------------------------------------------------------
def test_disk_full_exits_1_with_one_line(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl")
    one_line_error(run(str(inp), "-o", "/dev/full", "-q"), 1, "No space left on device", "0 records were written")
    with open("/dev/full", "wb") as full:
        result = subprocess.run(command(str(inp), "-o", "-", "-q"), env=env(), stdout=full, stderr=subprocess.PIPE,
                                timeout=300)
    one_line_error(result, 1, "stdout", "No space left on device")


def test_file_size_limit_mid_run_keeps_whole_lines_and_resume_finishes(tmp_path):
    """RLIMIT_FSIZE fails a write part-way through like a disk filling up (Python ignores SIGXFSZ: EFBIG)."""
    inp, out = slow_input(tmp_path / "in.jsonl", 8), tmp_path / "out.jsonl"

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    result = subprocess.run(command(str(inp), "-o", str(out), "-q"), env=env(), capture_output=True, timeout=300,
                            preexec_fn=small_disk)
    err = one_line_error(result, 1, "--resume")
    assert "records were written" in err and "File too large" in err, err
    assert 0 < out.stat().st_size <= 300
    resumed = run(str(inp), "-o", str(out), "-q", "--resume")
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert sorted(line["id"] for line in lines_of(out)) == list(range(8))


# -- 5: stdout closed ------------------------------------------------------------------------------
def test_closed_stdout_is_a_usage_error(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl")
    cmd = " ".join(f"'{a}'" for a in command(str(inp), "-o", "-"))
    result = subprocess.run(f"{cmd} >&-", shell=True, env=env(), capture_output=True, timeout=120)
    one_line_error(result, 2, "stdout is closed")


# -- 6: NaN and infinity ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_temperature_is_refused(tmp_path, value):
    inp = quick_input(tmp_path / "in.jsonl")
    one_line_error(run(str(inp), "-o", str(tmp_path / "out.jsonl"), "--temperature", value), 2,
                   "temperature", "finite")
    assert not (tmp_path / "out.jsonl").exists()


def test_sampling_params_refuse_every_non_finite_float():
    from llmcli import SamplingParams
    from llmcli.sampling_params import SamplingParamsError

    for name in ("temperature", "top_p", "min_p"):
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(SamplingParamsError, match=rf"{name}: must be a finite number"):
                SamplingParams(**{name: value})


# -- 7: user text is printed as written ------------------------------------------------------------
def test_messages_keep_emoji_codes_and_brackets_as_written(tmp_path):
    inp = tmp_path / "e100.jsonl"
    records = [{"prompt": "fine"}] * 98 + [{"prompt": "x", "temperature": ":smile:"},
                                           {"prompt": "x", "top_p": "[red]hot[/red]"}]
    write_jsonl(inp, records)
    err = one_line_error(run(str(inp), "-o", str(tmp_path / "out.jsonl")), 2)
    assert f"{inp}:99: temperature: must be a number, got string \":smile:\"" in err, err
    assert f"{inp}:100: top_p: must be a number, got string \"[red]hot[/red]\"" in err, err
    assert "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in err and "\N{HUNDRED POINTS SYMBOL}" not in err


# -- 8: implicit ids and explicit ones ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_an_implicit_id_equal_to_an_explicit_one_is_an_input_error(tmp_path, mode):
    records = [{"id": 5, "prompt_token_ids": [5, 6, 7], "max_tokens": 2}]
    records += [{"prompt_token_ids": [8 + i, 9], "max_tokens": 2} for i in range(4)]
    records += [{"prompt_token_ids": [1, 2], "temperature": "hot"}]  # line 6: implicit id 5, and invalid
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = run(str(inp), "-o", str(out), "--on-error", mode)
    one_line_error(result, 2, f"{inp}:6: id: duplicate id 5 (first used on line 1)", "repeat an id")
    assert not out.exists()


# -- 9: a stopped tensor-parallel rank -----------------------------------------------------------------
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")
def test_a_stopped_tensor_parallel_rank_is_reported_within_the_heartbeat_limit(tmp_path):
    inp, out = slow_input(tmp_path / "in.jsonl", 40), tmp_path / "out.jsonl"
    limit = 3.0
    proc = subprocess.Popen(command(str(inp), "-o", str(out), "-q", "-tp", "2"),
                            env={**env(), "LLMCLI_TP_HEARTBEAT_S": str(limit)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    worker = None
    try:
        wait_for_lines(proc, out, 1)
        workers = [pid for pid, state, cmd in child_processes(proc.pid) if "spawn" in cmd and state != "Z"]
        assert len(workers) == 1, child_processes(proc.pid)
        worker = workers[0]
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            proc.wait(timeout=limit + 30)
        except subprocess.TimeoutExpired:
            pytest.fail("a stopped rank was not detected")
        took = time.monotonic() - stopped
    finally:
        if worker is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(worker, sig)
                except ProcessLookupError:
                    pass
        proc.kill()
    err = proc.stderr.read().decode()
    assert proc.returncode == 1, err
    # The stop lands wherever the worker is: inside a step or between two (its phase is written as it changes)
    assert any(f"tensor-parallel rank 1 (pid {worker}) stopped responding while {phase}" in err
               for phase in ("running a", "waiting for rank 0's next call")), err
    assert "LLMCLI_TP_HEARTBEAT_S=3" in err and "Traceback" not in err, err
    # Judged on rank 0's clock from the last beat it saw (up to a tick before the stop), then the process ends:
    # both bounded far below any collective timeout (minutes), with room for a loaded 2-core CI machine.
    judged = float(re.search(r"no heartbeat for ([0-9.]+) s", err).group(1))
    assert limit <= judged < limit + 5, err
    assert limit - 1 <= took < limit + 25, took
    assert not wait_gone([worker]), "the stopped worker outlived the run"
    assert not list(Path("/dev/shm").glob(f"llmcli_tp_{proc.pid}_*"))
    lines = lines_of(out)  # what was answered stays, whole, for --resume
    assert lines and len({line["id"] for line in lines}) == len(lines)


# -- 10: IN as OUT, and another input -----------------------------------------------------------------
def test_in_and_out_the_same_file_is_refused(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl")
    before = inp.read_bytes()
    for flags in (["--resume"], ["--overwrite"]):
        one_line_error(run(str(inp), "-o", str(inp), *flags), 2, "IN and OUT are the same file")
    assert inp.read_bytes() == before


def test_resume_with_another_input_is_refused_unless_forced(tmp_path):
    inp, out = quick_input(tmp_path / "in.jsonl", 6), tmp_path / "out.jsonl"
    assert run(str(inp), "-o", str(out), "-q").returncode == 0
    assert (tmp_path / "out.jsonl.llmcli-input").exists()
    first_two = out.read_bytes().splitlines(keepends=True)[:2]
    out.write_bytes(b"".join(first_two))  # as an interrupted run leaves it

    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt_token_ids": [9, 9, 9 + i], "max_tokens": 2}
                                                   for i in range(6)])
    one_line_error(run(str(other), "-o", str(out), "--resume"), 2, "not the input that produced OUT",
                   "--force-resume")
    shorter = quick_input(tmp_path / "short.jsonl", 3)
    one_line_error(run(str(shorter), "-o", str(out), "--resume"), 2, "has 3 records", "had 6")
    assert out.read_bytes() == b"".join(first_two)  # refused runs leave OUT alone

    # Appending lines to IN is harmless: the first six are the ones that produced OUT.
    longer = quick_input(tmp_path / "longer.jsonl", 8)
    result = run(str(longer), "-o", str(out), "--resume")
    assert result.returncode == 0 and "6 records to run" in result.stderr.decode(), result.stderr.decode()
    assert sorted(line["id"] for line in lines_of(out)) == list(range(8))

    forced = run(str(other), "-o", str(out), "--force-resume", "-q")  # implies --resume; nothing left to run
    assert forced.returncode == 0, forced.stderr.decode()
    assert len(lines_of(out)) == 8


def test_the_fingerprint_ignores_formatting_but_not_content():
    from llmcli.cli.io.fingerprint import fingerprint
    from llmcli.cli.io.records import parse_line
    from llmcli.cli.io.source import RawLine

    def fp(*lines: bytes):
        return fingerprint([parse_line(RawLine(i + 1, line)) for i, line in enumerate(lines)])

    base = fp(b'{"prompt": "a", "temperature": 0}', b'{"id": "x", "prompt": "b"}')
    assert fp(b'{ "temperature": 0,  "prompt": "a" }', b'{"prompt":"b","id":"x"}') == base
    for changed in ((b'{"prompt": "A", "temperature": 0}', b'{"id": "x", "prompt": "b"}'),
                    (b'{"prompt": "a", "temperature": 1}', b'{"id": "x", "prompt": "b"}'),
                    (b'{"prompt": "a", "temperature": 0}', b'{"id": "y", "prompt": "b"}'),
                    (b'{"id": "x", "prompt": "b"}', b'{"prompt": "a", "temperature": 0}')):
        assert fp(*changed) != base, changed


# -- also seen -------------------------------------------------------------------------------------
def test_devices_and_pipes_as_out_are_not_fsynced(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl", 3)
    result = run(str(inp), "-o", "/dev/null", "-q")
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr.decode()
    cmd = " ".join(f"'{a}'" for a in command(str(inp), "-o", "/dev/stdout", "-q"))
    result = subprocess.run(f"{cmd} | cat", shell=True, env=env(), capture_output=True, timeout=300)
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr.decode()
    assert [orjson.loads(line)["id"] for line in result.stdout.splitlines()] == [0, 1, 2]
    assert not Path("/dev/null.llmcli-input").exists() and not Path("/dev/null.llmcli-lock").exists()


def test_a_huge_prompt_is_refused_by_its_size_before_tokenizing(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "the sea " * 1_250_000}])  # 10 MB
    started = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    err = one_line_error(run(str(inp), "-o", str(tmp_path / "out.jsonl")), 2, f"{inp}:1: prompt: prompt is "
                         "10000000 bytes, too long for max_model_len=256")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < max(started, 1_200_000), f"{peak_kib / 2**20:.1f} GiB: it was tokenized ({err})"


def test_resume_and_overwrite_together_is_a_usage_error(tmp_path):
    inp = quick_input(tmp_path / "in.jsonl")
    one_line_error(run(str(inp), "-o", str(tmp_path / "out.jsonl"), "--resume", "--overwrite"), 2,
                   "--resume and --overwrite")


def test_resume_after_error_records_exits_1_like_the_run_that_wrote_them(tmp_path):
    records = [{"prompt_token_ids": [5, 6], "max_tokens": 2}, {"prompt": "x", "temperature": "hot"},
               {"prompt_token_ids": [7, 8], "max_tokens": 2}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    assert run(str(inp), "-o", str(out), "-q", "--on-error", "skip").returncode == 1
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:2]))  # the error record stays
    result = run(str(inp), "-o", str(out), "--resume", "--on-error", "skip")
    assert result.returncode == 1, result.stderr.decode()
    assert "1 of them by error records" in result.stderr.decode()
    assert [line["id"] for line in lines_of(out)] == [0, 1, 2]
    nothing_left = run(str(inp), "-o", str(out), "--resume", "-q")
    assert nothing_left.returncode == 1, nothing_left.stderr.decode()


def test_a_request_too_big_for_the_pool_blames_the_field_that_is(tmp_path):
    # 4 blocks of 16 tokens: a 3-token prompt fits, 3 + 100 generated tokens do not; a 70-token prompt never does.
    records = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 100}, {"prompt_token_ids": list(range(3, 73)),
                                                                    "max_tokens": 1}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = subprocess.run(command(str(inp), "-o", str(out), "-q", "--on-error", "skip", blocks=4),
                            env=env(), capture_output=True, timeout=300)
    assert result.returncode == 1, result.stderr.decode()
    errors = [line["error"] for line in lines_of(out)]
    assert [e["field"] for e in errors] == ["max_tokens", "prompt_token_ids"], errors


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")
def test_a_tensor_parallel_rank_killed_inside_a_replica_costs_one_line(tmp_path):
    inp, out = slow_input(tmp_path / "in.jsonl", 24), tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(str(inp), "-o", str(out), "-q", "-tp", "2", "-dp", "2"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_lines(proc, out, 1, timeout=240)
        replicas = [pid for pid, state, cmd in child_processes(proc.pid) if "spawn" in cmd and state != "Z"]
        workers = [pid for r in replicas for pid, state, cmd in child_processes(r) if "spawn" in cmd]
        assert len(replicas) == 2 and len(workers) == 2, (replicas, workers)
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert sorted(line["id"] for line in lines_of(out)) == list(range(24))  # every input answered once
    assert "Traceback" not in err and "leaked" not in err, err
    lost = [line for line in err.splitlines() if line.strip()]
    assert len(lost) == 1 and f"tensor-parallel rank 1 (pid {workers[0]}) was killed by signal SIGKILL" in lost[0], err
