"""Capturing a benchmark's work in one CUDA graph, as the engine's decode steps run."""
from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], warmups: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmups`` calls on a side stream (compiles, autotuning and lazy
    allocations happen there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
