"""Every benchmark a CPU can run still runs: each script's ``--smoke`` mode (a tiny model, a few steps), as CI.

A benchmark that no longer matches the engine (a removed setting, a renamed function) fails here instead of on
the next GPU call. The GPU-only scripts (``tp_gpu.py``, ``gpu_smoke.py``) are left to ``gpu_session.sh``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from processes import env

REPO = Path(__file__).resolve().parent.parent

# (script and its arguments, a line its last output must contain: the figures it exists to print)
SMOKES = [
    (["bench_vs_hf.py", "--smoke"], "0 failure(s)"),
    (["speed_gpu.py", "--smoke"], "| Qwen3-tiny | prefill-heavy | base | True |"),
    (["host_step_cpu.py", "--smoke"], "| graph+sample |"),
    (["job_gpu.py", "--smoke"], "CLI overhead"),
    (["startup_gpu.py", "--smoke"], "tiny+cold+serial #1"),
    (["speed_gpu.py", "--smoke", "--preset", "logprobs"], "logprobs=5 against base:"),
    (["structured_bench.py", "--smoke", "--device", "cpu"], "every request produced its full length: True"),
    (["dp_gpu.py", "--smoke"], "0 failed run(s)"),
    (["lm_eval_gpu.py", "--smoke"], "| tiny-qwen3 | 16 | 64 |"),
    (["schedule_sim.py", "--smoke"], "| in groups |"),
]


@pytest.mark.slow
@pytest.mark.parametrize("cmd,expect", SMOKES, ids=[c[0] for c, _ in SMOKES])
def test_benchmark_smoke(cmd, expect, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / cmd[0]), *cmd[1:]], cwd=REPO,
                          env={**env(), "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{out[-3000:]}"
    assert expect in out, f"{' '.join(cmd)} did not print {expect!r}:\n{out[-3000:]}"


def test_gpu_session_script_parses_and_names_only_existing_scripts():
    script = REPO / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    named = {w.split("/")[1] for w in text.split() if w.startswith("benchmarks/") and w.endswith(".py")}
    assert named and all((REPO / "benchmarks" / n).exists() for n in named), named
