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
