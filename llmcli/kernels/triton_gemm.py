"""Thin-M GEMMs in Triton: ``x @ w.T`` for the few rows of a decode step, optionally with SiLU-and-mul fused in.

``silu_mul_linear(x, w)`` takes the merged gate/up weight ``w`` = [gate; up] ([2I, K]) and returns
``silu(x @ gate.T) * (x @ up.T)`` ([M, I]) without writing the [M, 2I] projection out and reading it back:
each program holds one tile of the gate and the matching tile of the up projection. ``linear(x, w)`` is the
same kernel without the epilogue (the thin-M alternative to cuBLAS, for A/B runs).

Decode GEMMs read every weight once per step and do little arithmetic per byte, so the tiles are chosen to
read each weight tile once for the whole batch where it fits: one M tile of up to 64 rows (two or four for
larger batches), N tiles of 64 columns and K tiles of 128. Accumulation is in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmcli.kernels import MAX_THIN_M  # noqa: F401 - the limit callers check


@triton.jit(do_not_specialize=["M"])  # the batch changes every step: one compiled kernel for all of them
def _thin_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, up_offset,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        if SILU_MUL:
            w_up = tl.load(w_ptr + (rn + up_offset)[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                           mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_up = tl.dot(x, w_up, acc_up)
    if SILU_MUL:
        # the reference rounds each projection to the model dtype before the activation
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = silu * up
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _run(x: torch.Tensor, w: torch.Tensor, n: int, silu_mul: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1 and x.shape[1] == w.shape[1]
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = _block_m(m)
    grid = (triton.cdiv(n, 64), triton.cdiv(m, block_m))
    _thin_gemm_kernel[grid](x, w, out, m, n, k, n, x.stride(0), w.stride(0), out.stride(0),
                            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, SILU_MUL=silu_mul, num_warps=4,
                            # four stages of float32 tiles need 256 KiB of shared memory at BLOCK_M 64 (an H200 SM
                            # has 227 KiB: Triton's OutOfResources in run 23's kernels stage); two fit
                            num_stages=4 if x.element_size() <= 2 else 2)
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` ([M, K] x [N, K] -> [M, N])."""
    return _run(x, w, w.shape[0], silu_mul=False)


def silu_mul_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w[:I].T) * (x @ w[I:].T)`` for a merged gate/up weight ``w`` of 2I rows."""
    assert w.shape[0] % 2 == 0
    return _run(x, w, w.shape[0] // 2, silu_mul=True)
