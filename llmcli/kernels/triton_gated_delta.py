"""Triton kernels of the Gated DeltaNet on CUDA that work on the state pool in place: the decode step of the
causal conv1d and of the gated delta rule, and the varlen causal conv1d of a prefill step.

Each batch entry's state is a row of the pool (``conv_state`` [slots, C, K-1], any strides: the pool keeps each
tap's channels contiguous, ``engine/state_pool.py``; ``ssm_state`` [slots, Hv, Dk, Dv]), found through ``rows``:
read, updated and written back where it lives, so a decode step moves each state once each way (a gather into a
batch and a scatter back would move it three times). Row -1 (a CUDA graph's padding rows) reads a zero state and
writes nothing. Math follows ``gated_delta_torch`` (the CPU path and these kernels' oracle) in float32: q and k
L2-normalised (eps inside the root), q scaled by ``Dk ** -0.5``, the decay ``g = -exp(A_log) * softplus(a +
dt_bias)`` and ``beta = sigmoid(b)`` (rounded to b's dtype, as the eager layer does) computed in the kernel from
the projection's raw ``a`` and ``b``; grouped value heads read their key head's q and k without repeating them.

Launch configurations are fixed (no autotuning): the decode kernels are captured in CUDA graphs. The delta
rule tiles the value dim (``DELTA_TILE``) so a batch of one still fills the GPU with (Hv x Dv / its width) programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the delta rule's tile: value columns of the state per program (a [Dk, 64] float32 tile is 32 KiB at Dk=128),
# and warps per program; tests/test_gpu_gated_delta.py sweeps nine pairs on the GPU: at batch 256 on an H200
# (64, 4) streamed the states at 3.48 TB/s, (32, 4) at 3.04 (benchmarks/RESULTS.md N1)
DELTA_TILE = (64, 4)
BLOCK_C = 256  # conv channels per program
BLOCK_T = 16  # prefill tokens per program of the varlen conv
NUM_WARPS = 4


@triton.jit
def _shifted(tile, by, KPAD: tl.constexpr):
    """``tile[:, j + by]`` as a [rows, KPAD] tile (zeros past the end), picked in registers: a state is read and
    written at the same addresses by the same threads, never read where another thread of the program stores."""
    oj = tl.arange(0, KPAD)
    pick = ((oj[:, None] + by) == oj[None, :]).to(tl.float32)
    return tl.sum(tile[:, None, :] * pick[None, :, :], 2)


@triton.jit
def _conv_state_tile(state_ptr, rows_ptr, i, stride_s0, stride_s1, stride_s2, K: tl.constexpr, KPAD: tl.constexpr,
                     BC: tl.constexpr):
    """Entry ``i``'s conv state in the pool, this program's channel block of it: (the [BC, KPAD] pointers, the
    channels, the state columns to read and write: K-1, none for row -1). A column count rather than a scalar
    mask: the interpreter masks by blocks only."""
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    row = tl.load(rows_ptr + i)
    ptrs = state_ptr + tl.where(row >= 0, row, 0) * stride_s0 + oc[:, None] * stride_s1 \
        + tl.arange(0, KPAD)[None, :] * stride_s2
    return ptrs, oc, tl.where(row >= 0, K - 1, 0)


@triton.jit
def _conv_step_kernel(x_ptr, w_ptr, state_ptr, rows_ptr, out_ptr, C, stride_x, stride_out,
                      stride_s0, stride_s1, stride_s2, K: tl.constexpr, KPAD: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    ptrs, oc, kept = _conv_state_tile(state_ptr, rows_ptr, b, stride_s0, stride_s1, stride_s2, K, KPAD, BC)
    oj = tl.arange(0, KPAD)
    mc = oc < C
    mask = mc[:, None] & (oj < kept)[None, :]
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + oc, mask=mc, other=0.0).to(tl.float32)
    # the window [state..., x] as a [BC, KPAD] tile; the next state is the window shifted by one
    window = tl.where((oj == K - 1)[None, :], x[:, None], tl.load(ptrs, mask=mask, other=0.0).to(tl.float32))
    w = tl.load(w_ptr + oc[:, None] * K + oj[None, :], mask=mc[:, None] & (oj < K)[None, :], other=0.0)
    y = tl.sum(window * w.to(tl.float32), 1)
    y = y * tl.sigmoid(y)
    tl.store(out_ptr + b.to(tl.int64) * stride_out + oc, y.to(out_ptr.dtype.element_ty), mask=mc)
    tl.store(ptrs, _shifted(window, 1, KPAD).to(state_ptr.dtype.element_ty), mask=mask)


def conv_step_(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One token per row: x [B, C] (rows may be strided), weight [C, K], the pool's conv_state [slots, C, K-1]
    updated in place at ``rows`` [B] (int64, -1: none) -> silu(conv) [B, C] in x's dtype."""
    batch, channels = x.shape
    width = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch:
        _conv_step_kernel[(batch, triton.cdiv(channels, BLOCK_C))](
            x, weight, conv_state, rows, out, channels, x.stride(0), out.stride(0), *conv_state.stride(), K=width,
            KPAD=triton.next_power_of_2(width), BC=BLOCK_C, num_warps=NUM_WARPS)
    return out


@triton.jit
def _delta_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, rows_ptr, out_ptr,
                       stride_q, stride_k, stride_v, stride_a, stride_b, stride_s0, stride_s1, stride_s2, scale,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ov = tl.program_id(2) * BV + tl.arange(0, BV)
    ok = tl.arange(0, BK)
    mk, mv = ok < DK, ov < DV
    b64 = b.to(tl.int64)
    row = tl.load(rows_ptr + b)
    valid = row >= 0
    hk = h // GROUP
    q = tl.load(q_ptr + b64 * stride_q + hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b64 * stride_k + hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + b64 * stride_v + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
    x = tl.load(a_ptr + b64 * stride_a + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)
    braw = tl.load(b_ptr + b64 * stride_b + h)
    beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)
    ptrs = state_ptr + tl.where(valid, row, 0) * stride_s0 + h * stride_s1 + ok[:, None] * stride_s2 + ov[None, :]
    mask = (ok < tl.where(valid, DK, 0))[:, None] & mv[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s += k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + (b64 * HV + h) * DV + ov, o.to(out_ptr.dtype.element_ty), mask=mv)
    tl.store(ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)


def gated_delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      a_log: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
    """One token per row: q/k [B, Hk, Dk], v [B, Hv, Dv] (head dims contiguous, rows may be strided), the raw
    a/b [B, Hv], A_log/dt_bias [Hv]; the pool's ssm_state [slots, Hv, Dk, Dv] updated in place at ``rows``
    -> out [B, Hv, Dv] in v's dtype."""
    batch, hk, dk = q.shape
    hv, dv = v.shape[1:]
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == t.shape[2], "heads of a row must be contiguous"
    assert a.stride(1) == 1 and b.stride(1) == 1 and ssm_state.stride(3) == 1
    out = torch.empty(batch, hv, dv, dtype=v.dtype, device=v.device)
    if batch:
        block_v, warps = DELTA_TILE
        _delta_step_kernel[(batch, hv, triton.cdiv(dv, block_v))](
            q, k, v, a, b, a_log, dt_bias, ssm_state, rows, out, q.stride(0), k.stride(0), v.stride(0),
            a.stride(0), b.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), dk ** -0.5,
            HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, num_warps=warps)
    return out


@triton.jit(do_not_specialize=["T"])  # the step's token count: one binary for all of them
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, rows_ptr, init_ptr, cu_ptr, seq_ptr, out_ptr, T, C,
                        stride_x, stride_out, stride_s0, stride_s1, stride_s2, K: tl.constexpr,
                        HAS_STATE: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr):
    ot = tl.program_id(0) * BT + tl.arange(0, BT)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = ot < T, oc < C
    seq = tl.load(seq_ptr + ot, mask=mt, other=0)
    bos = tl.load(cu_ptr + seq, mask=mt, other=0).to(tl.int64)
    if HAS_STATE:
        row = tl.load(rows_ptr + seq, mask=mt, other=-1)
        carried = mt & (tl.load(init_ptr + seq, mask=mt, other=0) != 0) & (row >= 0)
        row = tl.where(row >= 0, row, 0)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        src = ot.to(tl.int64) - (K - 1) + j  # the input token this tap reads; before bos: the carried state
        m = (mt & (src >= bos))[:, None] & mc[None, :]
        xv = tl.load(x_ptr + src[:, None] * stride_x + oc[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_STATE:
            col = (K - 1) + (src - bos)
            ms = (carried & (src < bos))[:, None] & mc[None, :]
            xv += tl.load(state_ptr + row[:, None] * stride_s0 + oc[None, :] * stride_s1 + col[:, None] * stride_s2,
                          mask=ms, other=0.0).to(tl.float32)
        acc += xv * tl.load(w_ptr + oc * K + j, mask=mc, other=0.0).to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + ot.to(tl.int64)[:, None] * stride_out + oc[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_state_varlen_kernel(x_ptr, state_ptr, rows_ptr, init_ptr, cu_ptr, C, stride_x, stride_s0, stride_s1,
                              stride_s2, K: tl.constexpr, KPAD: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0)
    ptrs, oc, kept = _conv_state_tile(state_ptr, rows_ptr, n, stride_s0, stride_s1, stride_s2, K, KPAD, BC)
    oj = tl.arange(0, KPAD)
    mc = oc < C
    bos = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - bos
    read = tl.where(tl.load(init_ptr + n) != 0, kept, 0)
    old = tl.load(ptrs, mask=mc[:, None] & (oj < read)[None, :], other=0.0).to(tl.float32)
    # the new state's inputs as positions in the chunk; before it (a chunk shorter than K-1): the old state's
    pos = length - (K - 1) + oj
    from_x = (pos >= 0) & (oj < K - 1)
    new = tl.load(x_ptr + (bos + pos)[None, :] * stride_x + oc[:, None], mask=mc[:, None] & from_x[None, :],
                  other=0.0).to(tl.float32)
    new = tl.where(from_x[None, :], new, _shifted(old, length, KPAD))
    tl.store(ptrs, new.to(state_ptr.dtype.element_ty), mask=mc[:, None] & (oj < kept)[None, :])


def conv_varlen_(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, rows: torch.Tensor,
                 has_initial_state: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The chunks ``cu_seqlens`` [N+1] cuts from x [T, C] (rows may be strided), each continuing the conv state
    of its pool row ``rows[i]`` when ``has_initial_state[i]`` (else from zeros); every row's state replaced by
    its chunk's last K-1 inputs in place (conv_state None: no pool, nothing read or kept) -> silu(conv) [T, C]."""
    tokens, channels = x.shape
    width = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    # each token's chunk, found on the device (no host sync)
    seq = torch.searchsorted(cu_seqlens, torch.arange(tokens, device=x.device, dtype=cu_seqlens.dtype),
                             right=True) - 1
    init = has_initial_state.to(torch.int8)
    if rows.data_ptr() % 16:  # a mixed step's rows after its decode rows: Triton would compile a second binary
        rows = rows.clone()
    state = conv_state if conv_state is not None else out
    strides = conv_state.stride() if conv_state is not None else (0, 0, 0)
    _conv_varlen_kernel[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
        x, weight, state, rows, init, cu_seqlens, seq, out, tokens, channels, x.stride(0), out.stride(0), *strides,
        K=width, HAS_STATE=conv_state is not None, BT=BLOCK_T, BC=BLOCK_C, num_warps=NUM_WARPS)
    if conv_state is not None:  # after the conv above has read every carried state
        _conv_state_varlen_kernel[(rows.numel(), triton.cdiv(channels, BLOCK_C))](
            x, conv_state, rows, init, cu_seqlens, channels, x.stride(0), *strides, K=width,
            KPAD=triton.next_power_of_2(width), BC=BLOCK_C, num_warps=NUM_WARPS)
    return out
