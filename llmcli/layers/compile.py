"""How the model's small elementwise functions run on CUDA: hand-written Triton kernels (the default), or fused by
torch.compile, or plain eager torch; CPU always runs the eager code.

``LLMCLI_EAGER=1`` makes everything eager; ``LLMCLI_ELEMENTWISE=triton|compile|eager`` picks for the model's
norms, activation and rotary (the sampler uses no torch.compile: Triton kernels on CUDA, eager torch otherwise).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

ELEMENTWISE_MODES = ("triton", "compile", "eager")


def compile_on_cuda(fn: F) -> F:
    """Run ``fn`` compiled when its first argument lives on a CUDA device (set LLMCLI_EAGER=1 to opt out)."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if args[0].is_cuda and os.environ.get("LLMCLI_EAGER") != "1":
            if compiled is None:
                # Duck sizing would tie e.g. a batch of 1024 tokens to a hidden size of 1024 and recompile
                # whenever such a coincidence appears or goes away; token counts vary every step.
                torch.fx.experimental._config.use_duck_shape = False
                # Round to the model dtype wherever the eager code does (Inductor otherwise keeps float32
                # between fused ops), so compiled and eager runs, and transformers, agree bit for bit more often.
                compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def elementwise_mode() -> str:
    """'triton', 'compile' or 'eager': how the model's elementwise functions run on CUDA."""
    if os.environ.get("LLMCLI_EAGER") == "1":
        return "eager"
    mode = os.environ.get("LLMCLI_ELEMENTWISE", "triton") or "triton"
    if mode not in ELEMENTWISE_MODES:
        raise ValueError(f"LLMCLI_ELEMENTWISE={mode!r}: expected one of {', '.join(ELEMENTWISE_MODES)}")
    return mode


def triton_kernels_on(t: torch.Tensor) -> bool:
    """Whether the elementwise functions run as their Triton kernels for tensors like ``t``."""
    return t.is_cuda and elementwise_mode() == "triton"


def triton_on_cuda(kernel: str) -> Callable[[F], F]:
    """Run the eager ``fn`` as ``llmcli.kernels.triton_elementwise.<kernel>`` (same signature) on CUDA.

    The kernel module is imported on first use only: importing a Triton module fixes whether its kernels are
    compiled or interpreted, and CPU runs never need it. ``__wrapped__`` stays the eager function."""

    def decorate(fn: F) -> F:
        compiled = compile_on_cuda(fn)
        triton_fn = None

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            nonlocal triton_fn
            if args[0].is_cuda:
                mode = elementwise_mode()
                if mode == "triton":
                    if triton_fn is None:
                        from llmcli.kernels import triton_elementwise

                        triton_fn = getattr(triton_elementwise, kernel)
                    return triton_fn(*args, **kwargs)
                if mode == "compile":
                    return compiled(*args, **kwargs)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
