"""Prefill and mixed steps as CUDA graphs, one set per token-count bucket, broken at every attention call.

A prefill-heavy step of ~16k tokens launches ~400 kernels eagerly; on a slow host that launching takes longer
than the device needs to run them (``benchmarks/RESULTS.md``, runs 25-28). Everything in a forward except the
attention backend's call depends only on the token count, so it can be captured: per bucket of T tokens the
forward is captured as ``num_layers + 1`` graphs, the pieces between two attention calls, and each step replays
them in order with the backend's call for that layer run eagerly in between, on the step's own metadata.
A step of n <= T tokens pads its inputs to T: padding rows go through the GEMMs and norms (row by row, so they
never touch a real row), and the attention calls see the first n rows only, so nothing of them is stored.

Capture works by handing the attention layers a recording stand-in for ``backend.forward``: each call ends the
graph being captured, notes the call's arguments (tensors at fixed addresses in the graphs' pool, or static
buffers) and an output buffer, and begins the next graph. Every layer's q/k/v projection writes one shared
buffer meanwhile (``QKVParallelLinear.static_out``), as every attention call writes one shared output buffer:
the tensors an eager call reads then hold no pool memory, and the pool stays one forward's worth. Capture and
replay are the CUDA-specific steps (``_capture``, ``run``); the CPU tests replace them with an eager forward at
the bucket's padded size that goes through ``attend`` and the shared buffers the same way.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend, QKNormRotary
from llmcli.layers.linear import QKVParallelLinear


def token_buckets(max_tokens: int, smallest: int = 512) -> list[int]:
    """Token counts that get graphs: powers of two from ``smallest`` and the midpoints between them (a step
    pads at most 1.5x, and less than 1.34x from 2,048 tokens), and ``max_tokens`` itself."""
    sizes = {max_tokens}
    b = smallest
    while b < max_tokens:
        sizes.update({b, b + b // 2})
        b *= 2
    return sorted(s for s in sizes if s <= max_tokens)


@dataclass
class AttentionCall:
    """One layer's backend call as captured: its inputs and where the next piece reads its output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    qk_norm: QKNormRotary | None
    out: torch.Tensor


class _Recorder:
    """Stands in for ``backend.forward`` while a bucket is captured (see the module docstring)."""

    def __init__(self, graphs: "PrefillGraphs", calls: list[AttentionCall], pieces: list[Any]) -> None:
        self.graphs, self.calls, self.pieces = graphs, calls, pieces

    def __call__(self, q, k, v, k_cache, v_cache, qk_norm: QKNormRotary | None = None) -> torch.Tensor:
        self.pieces.append(self.graphs.end_piece())
        out = self.graphs.attention_out(q)
        self.calls.append(AttentionCall(q, k, v, k_cache, v_cache, qk_norm, out))
        self.graphs.begin_piece()
        return out


class PrefillGraphs:
    """The model's forward for prefill and mixed steps of up to ``max(buckets)`` tokens, piece by piece."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, buckets: list[int], device: torch.device,
                 ) -> None:
        self.model, self.backend, self.buckets, self.device = model, backend, buckets, device
        self._attention = backend.forward  # bound before capture shadows it on the instance
        top = buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.pieces: dict[int, list[Any]] = {}
        self.calls: dict[int, list[AttentionCall]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None
        self._out: torch.Tensor | None = None
        self._qkv: torch.Tensor | None = None
        self._open: Any = None
        free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        stream = None
        if device.type == "cuda":  # graphs are captured on a side stream that starts after the work so far
            torch.cuda.synchronize(device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else nullcontext()):
            for t in reversed(buckets):  # largest first: the smaller ones fit in the memory it leaves free
                self._capture(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 0

    # -- capture ---------------------------------------------------------------------------------------------
    def qkv_buffer(self) -> torch.Tensor:
        """The flat buffer every layer's q/k/v projection writes while a bucket is captured (one for all
        buckets, sized for the largest)."""
        if self._qkv is None:
            width = max(m.weight.shape[0] for m in self.model.modules() if isinstance(m, QKVParallelLinear))
            dtype = next(self.model.parameters()).dtype
            self._qkv = torch.empty(self.buckets[-1] * width, dtype=dtype, device=self.device)
        return self._qkv

    def attention_out(self, q: torch.Tensor) -> torch.Tensor:
        """Where a layer's attention output goes: one buffer for every layer and bucket, outside the pool (the
        eager call writes it, the next piece reads it, and only then does the next layer's call write it)."""
        if self._out is None or self._out.dtype != q.dtype:
            self._out = torch.empty(self.buckets[-1] * q[0].numel(), dtype=q.dtype, device=q.device)
        return self._out[:q.numel()].view(q.shape)

    def begin_piece(self) -> None:
        """Start capturing the next piece into the pool every piece of every bucket shares."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._open = graph

    def end_piece(self) -> Any:
        """Stop capturing the current piece and return its graph (anything with ``replay()``)."""
        graph, self._open = self._open, None
        graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def _capture(self, t: int) -> None:
        calls: list[AttentionCall] = []
        pieces: list[Any] = []
        # an eager pass first (kernels compiled, cuBLAS set up), attention skipped: nothing is prepared for it
        self.backend.forward = lambda q, k, v, k_cache, v_cache, qk_norm=None: torch.empty_like(q)
        try:
            self.model(self.input_ids[:t], self.positions[:t])
        finally:
            del self.backend.forward
        self.backend.forward = _Recorder(self, calls, pieces)  # shadows the method on this instance only
        QKVParallelLinear.static_out = self.qkv_buffer()
        try:
            self.begin_piece()
            hidden = self.model(self.input_ids[:t], self.positions[:t])
            pieces.append(self.end_piece())
        finally:
            del self.backend.forward
            QKVParallelLinear.static_out = None
        self.pieces[t], self.calls[t], self.outputs[t] = pieces, calls, hidden

    # -- steps -----------------------------------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's ``n`` rows; the backend must be ``prepare``-d for the step already."""
        n = input_ids.shape[0]
        t = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        pieces = self.pieces[t]
        for piece, call in zip(pieces, self.calls[t]):
            piece.replay()
            self.attend(call.q, call.k, call.v, call.k_cache, call.v_cache, call.qk_norm, call.out, n)
        pieces[-1].replay()
        return self.outputs[t][:n]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
               v_cache: torch.Tensor | None, qk_norm: QKNormRotary | None, out: torch.Tensor, n: int) -> None:
        """One layer's backend call on the step's first ``n`` rows, eagerly, into ``out[:n]``."""
        if qk_norm is not None:
            qk_norm = dataclasses.replace(qk_norm, positions=qk_norm.positions[:n])
        if getattr(self.backend, "writes_out", False):
            self._attention(q[:n], k[:n], v[:n], k_cache, v_cache, qk_norm, out=out[:n])
        else:
            out[:n].copy_(self._attention(q[:n], k[:n], v[:n], k_cache, v_cache, qk_norm))

    def release(self) -> None:
        for pieces in self.pieces.values():
            for piece in pieces:
                reset: Callable[[], None] | None = getattr(piece, "reset", None)
                if reset is not None:
                    reset()
        self.pieces.clear()
        self.calls.clear()
        self.outputs.clear()
