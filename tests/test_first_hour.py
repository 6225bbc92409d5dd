"""A newcomer's first hour (issue 45): progress in a log, what -q keeps, the summary's notes, the final frame
on a terminal that OUT's records also go to."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from llmcli.cli.app import app
from llmcli.cli.prefix_hint import SharedPrefixes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import REPO, env  # noqa: E402
from test_cli_ux import engine_args, write_jsonl  # noqa: E402

runner = CliRunner()
NOTE = ("4 records stopped at a length limit they do not set (the default max_tokens: 256 for plain records, 16 "
        "for OpenAI completions, the context for OpenAI chat); give max_tokens in a record, or --max-tokens, to "
        "let them run longer")


def test_progress_lines_every_30_seconds_by_default():
    from llmcli.cli import progress

    assert progress.LOG_INTERVAL_S == 30.0 and progress.log_interval_s() == 30.0  # LLMCLI_PROGRESS_INTERVAL_S unset


def test_progress_lines_appear_in_a_log_while_the_run_goes_on(tiny_model, tmp_path):
    """stderr a file (cron): with --progress, plain lines come while the run goes on, not only at its end. The
    interval is shortened to 0.5 s here; the one above checks that the real default is 30 s."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox {i}", "max_tokens": 120} for i in range(8)])
    log = tmp_path / "run.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(tmp_path / "o.jsonl"),
                                 *engine_args(tiny_model), "--max-num-seqs", "2", "--ignore-eos", "--progress"],
                                env={**env(), "LLMCLI_PROGRESS_INTERVAL_S": "0.5"}, stdout=subprocess.DEVNULL,
                                stderr=err)
        try:
            deadline, seen = time.monotonic() + 120, ""
            while proc.poll() is None and time.monotonic() < deadline:
                seen = log.read_text()
                if "records written" in seen:
                    break
                time.sleep(0.1)
            running = proc.poll() is None
        finally:
            proc.wait(timeout=180)
    assert running, "the run ended before any progress line: make it longer"
    assert proc.returncode == 0, log.read_text()
    line = next(x for x in seen.splitlines() if "records written" in x)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d generate: \d/8 records written, \d+% of 960 tokens, "
                        r"gen [\d.]+k? tok/s, prompt [\d.]+k? tok/s, elapsed 0:00:\d\d, eta (\d:\d\d:\d\d|-:--:--)",
                        line), line
    text = log.read_text()
    assert "━" not in text and "\x1b[" not in text  # no bar, no cursor movement in a log
    assert re.search(r"generate: 8/8 records written, 100% of 960 tokens, .* done after", text)


def test_quiet_keeps_the_typo_warning_and_hides_the_summary(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "temprature": 0.5, "max_tokens": 2}])
    result = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "-q"])
    assert result.exit_code == 0, result.output
    assert 'unknown field "temprature" on line 1; ignored (did you mean "temperature"?)' in result.stderr
    assert "requests answered" not in result.stderr and "records to run" not in result.stderr


def test_the_length_limit_note_is_silent_when_max_tokens_is_given(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    given = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--ignore-eos", "--max-tokens", "3"])
    assert given.exit_code == 0, given.output
    assert all(r["finish_reason"] == "length" for r in map(orjson.loads, given.stdout.splitlines()))
    assert "length limit they do not set" not in given.stderr
    assert re.search(r"cut at a default length limit\s*│\s*0\b", given.stderr), given.stderr
    # without --max-tokens, the built-in limit (here the 256-token context) cuts them, and the note says so
    default = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model), "--ignore-eos", "-q"])
    assert "2 records stopped at a length limit they do not set (the default max_tokens" in default.stderr


def test_the_block_size_hint_names_a_size_that_shares_the_prefix():
    shared = list(range(1000, 1040))  # 40 tokens every prompt starts with
    tally = SharedPrefixes(64)
    for i in range(20):
        tally.observe(shared + [i] * (10 + i))
    hint = tally.hint(0.0)
    assert hint is not None and "19 of 20 prompts share their first ~40 tokens" in hint
    assert "less than one 64-token KV block" in hint and "--block-size 32 would share 32 of them" in hint
    assert tally.hint(0.5) is None  # the cache hits: nothing to say
    whole = SharedPrefixes(16)  # 40 shared tokens fill two 16-token blocks: the cache shares them already
    for i in range(20):
        whole.observe(shared + [i] * 5)
    assert whole.hint(0.0) is None
    apart = SharedPrefixes(64)
    for i in range(20):
        apart.observe([i] * 50)
    assert apart.hint(0.0) is None


def test_the_summary_hints_at_block_size_end_to_end(tiny_model, tmp_path):
    shared = [5 + j for j in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": shared + [100 + i, 7], "max_tokens": 1}
                                              for i in range(10)])
    args = [a if a != "16" else "64" for a in engine_args(tiny_model)]  # --block-size 64
    result = runner.invoke(app, ["generate", str(inp), *args], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "9 of 10 prompts share their first ~40 tokens" in result.stderr and "--block-size 32" in result.stderr
    small = runner.invoke(app, ["generate", str(inp), *engine_args(tiny_model)], env={"COLUMNS": "400"})
    assert "--block-size" not in small.stderr  # 16-token blocks share 32 of the 40: the cache hits


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_records_and_progress_on_one_terminal(tiny_model, tmp_path):
    """`-o -` in an 80x24 tmux pane: no bar redrawn over the records, every record whole, the note after the
    summary wrapped between words."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox {i}"} for i in range(4)])
    done = tmp_path / "done"
    args = " ".join(a if a != "256" else "40" for a in engine_args(tiny_model))  # --max-model-len 40
    cmd = f"{sys.executable} -m llmcli generate {inp} -o - {args} --ignore-eos; touch {done}; sleep 60"
    session = f"llmcli-first-hour-{tmp_path.name}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True,
                   env=env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(0.5)
        joined = subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-200", "-t", session],
                                capture_output=True, text=True, check=True).stdout
        pane = subprocess.run(["tmux", "capture-pane", "-p", "-S", "-200", "-t", session], capture_output=True,
                              text=True, check=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert done.exists(), pane
    records = [line for line in joined.splitlines() if line.startswith("{")]
    assert len(records) == 4 and all(orjson.loads(r)["finish_reason"] == "length" for r in records), joined
    assert "━" not in pane and "requests answered" in pane
    assert re.search(r"generate: 4/4 records written, 100% .* done after", joined)
    assert all(len(line) <= 80 for line in pane.splitlines())
    lines = pane[pane.index("4 records stopped at a length limit"):].split("\n\n")[0].splitlines()
    assert len(lines) > 1 and " ".join(line.rstrip() for line in lines).split() == NOTE.split(), lines
