"""The fused MoE over MXFP4 experts: the grouped GEMMs of ``triton_moe.py`` reading 4-bit weights as stored.

An expert tensor of ``N`` output rows over ``K`` inputs is held as ``q`` uint8 [E, N, K / 2] (two e2m1 codes a
byte, the low nibble first along K) and ``s`` uint8 [E, N, K / 32] (an e8m0 exponent per 32 values, bias 127):
4.25 bits a weight. Each program loads its weight tile's bytes and scales, turns them into the activations' dtype
in registers (code -> float32 bits, times the scale's power of two) and feeds the tensor cores as the 16-bit
kernels do, accumulating in float32. No 16-bit copy of the experts exists anywhere: decode steps, which read
every touched expert once, move a quarter of the bytes.

The routing (``align_by_expert``) and the tile walk (``_tile``) are ``triton_moe.py``'s, the tile sizes its own
(``mxfp4_tuning``); the epilogues round where that kernel rounds, so the two agree on the same values.
``K`` must be a multiple of 32 (the format's groups): the hidden size and each rank's intermediate share.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmcli.kernels.triton_moe import MoeTuning, _tile, grouped_launch


def mxfp4_tuning(num_pairs: int, num_experts: int) -> MoeTuning:
    """Unpacking a weight tile costs a dozen integer operations a value, paid once per row tile, so an expert's
    rows share as few row tiles as fit: 16-row tiles 128 deep where each expert sees a few rows (64 bytes of codes
    a weight row a load), one 64-row tile up to 64 rows (decode at large batches: the tensor cores' padding is
    cheap, a second unpacking is not), 64 x 128 tiles beyond (prefill)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return MoeTuning(block_m=16, block_n=64, block_k=128)
    if per_expert <= 64:
        return MoeTuning(block_m=64, block_n=64, block_k=64, num_warps=8)
    return MoeTuning(block_m=64, block_n=128, block_k=64, num_warps=8)


@triton.jit
def _dequant(codes, scales, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 codes [BLOCK_N, BLOCK_K / 2] and e8m0 scales [BLOCK_N, BLOCK_K / 32] -> DTYPE [BLOCK_K, BLOCK_N]."""
    nibbles = tl.join(codes & 0x0F, codes >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.int32)  # in K order
    mag = nibbles & 7  # (exponent << 1) | mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    # normal codes: e2m1's exponent field rebased to float32's (+126), the mantissa bit on top of float32's
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    values = (bits | ((nibbles & 8) << 28)).to(tl.float32, bitcast=True)
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127); 0 where masked
    values = values.reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None]
    return tl.trans(values.reshape(BLOCK_N, BLOCK_K).to(DTYPE))


@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_gate_up_kernel(x_ptr, q_ptr, s_ptr, out_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, inter, hidden,
                          stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                          TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, PRECISION: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False,
                          CLAMPED: tl.constexpr = False, alpha=1.0, limit=0.0):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, inter,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    dtype = x_ptr.dtype.element_ty
    tokens = pairs // TOP_K
    ks = tl.arange(0, BLOCK_K)
    kb = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    x_tile = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + ks[None, :]
    e = expert.to(tl.int64)
    gate_q = q_ptr + e * stride_qe + cols[:, None] * stride_qn + kb[None, :]
    up_q = gate_q + inter * stride_qn
    gate_s = s_ptr + e * stride_se + cols[:, None] * stride_sn + kg[None, :]
    up_s = gate_s + inter * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        left = hidden - k0
        a = tl.load(x_tile, mask=row_ok[:, None] & (ks < left)[None, :], other=0.0)
        q_ok = col_ok[:, None] & (kb < left // 2)[None, :]
        s_ok = col_ok[:, None] & (kg < left // 32)[None, :]
        g = _dequant(tl.load(gate_q, mask=q_ok, other=0), tl.load(gate_s, mask=s_ok, other=0), dtype, BLOCK_N,
                     BLOCK_K)
        u = _dequant(tl.load(up_q, mask=q_ok, other=0), tl.load(up_s, mask=s_ok, other=0), dtype, BLOCK_N, BLOCK_K)
        gate = tl.dot(a, g, gate, input_precision=PRECISION)
        up = tl.dot(a, u, up, input_precision=PRECISION)
        x_tile += BLOCK_K
        gate_q += BLOCK_K // 2
        up_q += BLOCK_K // 2
        gate_s += BLOCK_K // 32
        up_s += BLOCK_K // 32
    if BIAS:
        b_row = b_ptr + e * 2 * inter
        gate += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_row + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # rounded as triton_moe's gate/up epilogue rounds (as the eager activation over a stored projection)
    gate = gate.to(dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_down_kernel(a_ptr, q_ptr, s_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs,
                       hidden, inter, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PRECISION: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, hidden,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    dtype = a_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    kb = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    e = expert.to(tl.int64)
    a_tile = a_ptr + pairs[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_q = q_ptr + e * stride_qe + cols[:, None] * stride_qn + kb[None, :]
    w_s = s_ptr + e * stride_se + cols[:, None] * stride_sn + kg[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        left = inter - k0
        a = tl.load(a_tile, mask=row_ok[:, None] & (ks < left)[None, :], other=0.0)
        w = _dequant(tl.load(w_q, mask=col_ok[:, None] & (kb < left // 2)[None, :], other=0),
                     tl.load(w_s, mask=col_ok[:, None] & (kg < left // 32)[None, :], other=0), dtype, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_tile += BLOCK_K
        w_q += BLOCK_K // 2
        w_s += BLOCK_K // 32
    if BIAS:
        acc += tl.load(b_ptr + e * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _check_packed(q: torch.Tensor, s: torch.Tensor, name: str) -> None:
    if q.dtype != torch.uint8 or s.dtype != torch.uint8 or q.dim() != 3 or s.shape != (*q.shape[:2], q.shape[2] // 16) \
            or q.shape[2] % 16:
        raise ValueError(f"{name}: MXFP4 codes [E, N, K/2] and scales [E, N, K/32] as uint8 with K a multiple of 32, "
                         f"got {tuple(q.shape)} {q.dtype} and {tuple(s.shape)} {s.dtype}")


def fused_moe_mxfp4(x: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor,
                    w2_s: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    tuning: MoeTuning | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """[T, H] -> [T, H], as ``triton_moe.fused_moe`` with MXFP4 experts: ``w13_q`` [E, 2I, H/2] / ``w13_s``
    [E, 2I, H/32] (gate rows then up rows), ``w2_q`` [E, H, I/2] / ``w2_s`` [E, H, I/32]; ``b13`` [E, 2I] and
    ``b2`` [E, H] the biases, ``clamp`` gpt-oss's ``(alpha, limit)``."""
    _check_packed(w13_q, w13_s, "gate/up experts")
    _check_packed(w2_q, w2_s, "down experts")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13_q.shape
    inter = two_inter // 2
    if w13_q.shape[2] * 2 != hidden or w2_q.shape[1:] != (hidden, inter // 2):
        raise ValueError(f"MXFP4 experts {tuple(w13_q.shape)} / {tuple(w2_q.shape)} do not fit hidden size {hidden}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    tuning = tuning or mxfp4_tuning(num_pairs, num_experts)
    x, w13_q, w13_s, w2_q, w2_s = (t.contiguous() for t in (x, w13_q, w13_s, w2_q, w2_s))
    pairs, experts, total, tiles_m, act, launch = grouped_launch(x, topk_ids, num_experts, inter, tuning)
    _mxfp4_gate_up_kernel[(tiles_m * triton.cdiv(inter, tuning.block_n),)](
        x, w13_q, w13_s, act, pairs, experts, total, num_pairs, inter, hidden,
        x.stride(0), w13_q.stride(0), w13_q.stride(1), w13_s.stride(0), w13_s.stride(1), act.stride(0), TOP_K=top_k,
        b_ptr=None if b13 is None else b13.contiguous(), BIAS=b13 is not None, CLAMPED=clamp is not None,
        alpha=float(clamp[0]) if clamp else 1.0, limit=float(clamp[1]) if clamp else 0.0, **launch)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _mxfp4_down_kernel[(tiles_m * triton.cdiv(hidden, tuning.block_n),)](
        act, w2_q, w2_s, down, topk_weights.float().contiguous(), pairs, experts, total, num_pairs, hidden, inter,
        act.stride(0), w2_q.stride(0), w2_q.stride(1), w2_s.stride(0), w2_s.stride(1), down.stride(0),
        b_ptr=None if b2 is None else b2.contiguous(), BIAS=b2 is not None, **launch)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
