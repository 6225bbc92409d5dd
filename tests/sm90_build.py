"""Building Triton kernels for an H100/H200 on a machine without a GPU: Triton's own ptxas, in a fresh process (the
tests around it run the kernels under the interpreter, which fixes interpreted vs compiled at import)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def build_for_sm90(script: str, timeout: int = 600) -> str:
    """Run ``script`` (which calls ``triton.compile`` with ``GPUTarget("cuda", 90, 32)``) compiled, not interpreted;
    its standard output. Skips where this Triton has no NVIDIA backend; fails with the script's error."""
    if "nvidia" not in __import__("triton.backends").backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
