"""The device switch of the kernel micro-benchmarks: a GPU run, or Triton's interpreter as a CPU smoke test."""
from __future__ import annotations

import os
import sys

import torch


def use_kernel_device(device: str) -> None:
    """``cpu``: run Triton kernels in the interpreter (call before any kernel module is imported); ``cuda``: exit
    with a hint when no GPU is visible."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for the interpreter smoke test")
