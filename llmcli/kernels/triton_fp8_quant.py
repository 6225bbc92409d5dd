"""Per-token FP8 quantization of activations in one Triton kernel (the FP8 linear method's input, on CUDA).

One program per row: the row's largest magnitude over 448 is its scale, and the row divided by it, saturated,
is stored as e4m3, with the scale in float32 (``[rows, 1]``, what ``torch._scaled_mm``'s row-wise scaling
reads). Eager torch spends five kernels on the same (abs, amax, divide, clamp, cast), which in a decode step of
an 8B model (4 linear layers x 36 layers) would add some 700 launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)  # an all-zero row gets a tiny scale, not a division by zero


@triton.jit(do_not_specialize=["stride_x"])
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (last dimension contiguous) as e4m3 [M, K] and float32 per-row scales [M, 1]."""
    m, k = x.shape
    assert x.stride(-1) == 1, "rows must be contiguous"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(m,)](x, q, s, x.stride(0), K=k, BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=4)
    return q, s
