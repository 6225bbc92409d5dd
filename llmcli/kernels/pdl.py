"""Programmatic dependent launch (PDL): whether llmcli's Triton kernels launch with it, one switch per process.

On Hopper and later, a kernel launched with PDL may start while the kernel before it in the stream is still
finishing. Each of our PDL-aware kernels does only work that cannot depend on its predecessor (asking L2 for
its weights) before ``griddepcontrol.wait``, and signals ``launch_dependents`` only after its own wait, so a
kernel past its wait knows every earlier kernel has completed. The hope was to hide the launch gaps of a 0.6B
decode step, whose ~300 kernels run for a few microseconds each; measured on an H200 it changes the default bench
by -0.1 to +0.9% (within run-to-run noise: most kernel boundaries there touch a cuBLAS GEMM, which does not take
part), and the Triton GEMMs do not beat cuBLAS even with it (benchmarks/RESULTS.md runs 32-36). So it is off by
default.

The switch is process-wide because the kernels are module functions shared by every layer; the model runner
sets it from ``Config.pdl`` before the first launch (compilations are cached per setting, so flipping it in a
benchmark costs a compile, not a wrong result).
"""
from __future__ import annotations

import os

import torch

_enabled = False


def supported(device: torch.device) -> bool:
    """PDL needs compiled kernels on a GPU of compute capability 9.0 or later."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def enable(on: bool, device: torch.device) -> bool:
    """Turn PDL on where the device supports it; returns whether it is on."""
    global _enabled
    _enabled = bool(on) and supported(device)
    return _enabled


def enabled() -> bool:
    return _enabled


def options() -> dict:
    """Launch options for a PDL-aware kernel (its ``PDL`` constexpr must be ``enabled()`` too)."""
    return {"launch_pdl": True} if _enabled else {}
