"""Fusing small elementwise functions with torch.compile on CUDA; plain eager code on CPU."""
from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


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
