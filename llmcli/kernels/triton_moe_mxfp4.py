"""The fused MoE over MXFP4 experts: the grouped GEMMs of ``triton_moe.py`` reading 4-bit weights as stored.

An expert tensor of ``N`` output rows over ``K`` inputs is held as ``q`` uint8 [E, N, K / 2] (two e2m1 codes a
byte, the low nibble first along K) and ``s`` uint8 [E, N, K / 32] (an e8m0 exponent per 32 values, bias 127):
4.25 bits a weight. No 16-bit copy of the experts exists anywhere: decode steps, which read every touched expert
once, move a quarter of the bytes. Each program turns its weight tile's codes into values in registers, one of
two ways (``mxfp4_kernel``; ``LLMCLI_MXFP4_KERNEL=scaled|dequant|frag`` picks for an A/B; ``frag`` is the
third, Hopper's form over experts stored in another layout: ``triton_moe_mxfp4_frag.py``):

* ``scaled`` (the default for bf16/fp16 activations; on an H200 1.1x to 1.7x the bf16 kernel at gpt-oss-20b's
  decode batches, ``benchmarks/RESULTS.md`` N1): ``tl.dot_scaled`` with the codes as its packed-along-K
  right operand, loaded [K / 2, N] straight from the [N, K / 2] rows (the pointer strides swapped), and the scales
  as [N, K / 32]. On sm_90 Triton (3.6) copies the codes to shared memory asynchronously, upcasts them with
  byte-permute lookups in the layout the tensor cores read and multiplies by the scale as a 16-bit power of two
  (exact): 5 to 8 instructions a weight at the tiles picked, where ``dequant``'s float32 integer-and-select
  decode takes 13 to 18 (counted in the sm_90 SASS of both).
* ``dequant`` (float32's only path; the first kernel's decode, 0.65x the bf16 kernel on an H200): integer
  ops on the codes, in float32, to the activations' dtype, then ``tl.dot``.

Either way the scales of the next K tile are loaded a tile ahead: 1-byte loads, which the pipeliner does not turn
into asynchronous copies, and whose latency would otherwise stall every iteration.

The routing (``align_by_expert``) and the tile walk (``_tile``) are ``triton_moe.py``'s, the tile sizes its own
(``mxfp4_tuning``); the epilogues round where that kernel rounds, so the two agree on the same values.
``K`` must be a multiple of 32 (the format's groups): the hidden size and each rank's intermediate share.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llmcli.kernels.triton_moe import MoeTuning, _tile, gated_activation, grouped_launch, settled

KERNELS = ("scaled", "dequant", "frag")


def frag_runs_on(device: torch.device) -> bool:
    """Whether ``frag`` runs natively on ``device``: Hopper (its register-fed MMA, ``mul.bf16x2``); Triton's
    interpreter (a CPU device) runs its emulation."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


def mxfp4_kernel(dtype: torch.dtype, kernel: str | None = None, device: torch.device | None = None) -> str:
    """The tile product for activations of ``dtype`` on ``device`` (default: CUDA's): ``kernel``, else
    ``LLMCLI_MXFP4_KERNEL``, else ``scaled``. Always ``dequant`` for float32 on a GPU (``tl.dot_scaled`` does not
    take it); ``frag`` on a GPU only on Hopper with bfloat16 activations, ``scaled`` (or ``dequant``) elsewhere."""
    kernel = kernel or os.environ.get("LLMCLI_MXFP4_KERNEL") or "scaled"
    if kernel not in KERNELS:
        raise ValueError(f"MXFP4 kernel {kernel!r}: one of {', '.join(KERNELS)}")
    device = device or torch.device("cuda")
    if kernel == "frag" and device.type == "cuda" and (dtype != torch.bfloat16 or not frag_runs_on(device)):
        kernel = "scaled"
    if kernel == "frag":
        return kernel
    return "dequant" if dtype == torch.float32 else kernel


def mxfp4_tuning(num_pairs: int, num_experts: int, kernel: str = "scaled") -> MoeTuning:
    """An expert's rows share as few row tiles as fit, as unpacking a weight tile is paid once per row tile:
    16-row tiles where each expert sees a few rows, 64-row tiles beyond (decode at large batches: the tensor
    cores' padding is cheap, a second unpacking is not).

    ``scaled``: 16 x 32 tiles 128 deep on 2 warps at decode, mma.sync reading the codes from shared memory in
    16-byte loads (5.3 sm_90 instructions a gate/up weight; 16 x 64 on 4 warps, the swapped wgmma, takes 6.3 and
    reads them byte by byte), and twice the programs of 64 columns: gpt-oss-20b's 1-token step runs 4 experts x
    90 column tiles, 2.7 a multiprocessor. 64 x 64 x 64 on 4 warps up to 64 rows an expert (the fastest of four
    candidates at 256 tokens on an H200, 391 us where 64 x 128 x 64 on 8 warps took 435), which stays beyond
    (prefill: 174 registers where 64 x 64 x 128 on 4 warps needs 254). ``dequant``: the first kernel's tiles."""
    per_expert = num_pairs / num_experts
    if kernel == "scaled":
        if per_expert <= 16:
            return MoeTuning(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=4)
        if per_expert <= 64:
            return MoeTuning(block_m=64, block_n=64, block_k=64, num_warps=4)
        return MoeTuning(block_m=64, block_n=128, block_k=64, num_warps=8)
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


@triton.jit
def _codes_at(base, cols, stride_n, SCALED: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers to a weight tile's first BLOCK_K / 2 code bytes of rows ``cols``: [BLOCK_K / 2, BLOCK_N] for
    ``dot_scaled`` (its right operand packed along K), [BLOCK_N, BLOCK_K / 2] for ``_dequant``."""
    kb = tl.arange(0, BLOCK_K // 2)
    if SCALED:  # one return: the two shapes differ
        ptrs = base + cols[None, :] * stride_n + kb[:, None]
    else:
        ptrs = base + cols[:, None] * stride_n + kb[None, :]
    return ptrs


@triton.jit
def _load_codes(ptrs, left, col_ok, SCALED: tl.constexpr, BLOCK_K: tl.constexpr):
    k_ok = tl.arange(0, BLOCK_K // 2) < left // 2  # ``left``: values of K from here on
    if SCALED:
        codes = tl.load(ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
    else:
        codes = tl.load(ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
    return codes


@triton.jit
def _load_scales(ptrs, left, col_ok, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 32]; masked past K (``left`` <= 0: the tile after the last, no access) to 0."""
    return tl.load(ptrs, mask=col_ok[:, None] & (tl.arange(0, BLOCK_K // 32) < left // 32)[None, :], other=0)


@triton.jit
def _product(a, codes, scales, acc, SCALED: tl.constexpr, FORMAT: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ the weight tile's values [BLOCK_K, BLOCK_N], in float32."""
    if SCALED:
        # fast_math: a 0xFF scale (NaN in e8m0) is not special-cased, as _dequant does not; masked codes and
        # scales are 0, so values past K are 0 whichever scale the upcast makes of byte 0. With fp16 activations
        # the scale is an fp16 itself: exact for e8m0 exponents 103 to 142 (2^-24 to 2^15), checkpoints' range
        return tl.dot_scaled(a, None, FORMAT, codes, scales, "e2m1", acc, fast_math=True)
    return tl.dot(a, _dequant(codes, scales, a.dtype, BLOCK_N, BLOCK_K), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_gate_up_kernel(x_ptr, q_ptr, s_ptr, out_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, inter, hidden,
                          stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                          TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
                          FORMAT: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False,
                          CLAMPED: tl.constexpr = False, alpha=1.0, limit=0.0, SETTLE: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, inter,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    dtype = x_ptr.dtype.element_ty
    tokens = pairs // TOP_K
    ks = tl.arange(0, BLOCK_K)
    kg = tl.arange(0, BLOCK_K // 32)
    x_tile = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + ks[None, :]
    e = expert.to(tl.int64)
    gate_q = _codes_at(q_ptr + e * stride_qe, cols, stride_qn, SCALED, BLOCK_K)
    up_q = gate_q + inter * stride_qn
    gate_s = s_ptr + e * stride_se + cols[:, None] * stride_sn + kg[None, :]
    up_s = gate_s + inter * stride_sn
    gate_next = _load_scales(gate_s, hidden, col_ok, BLOCK_K)
    up_next = _load_scales(up_s, hidden, col_ok, BLOCK_K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        left = hidden - k0
        a = tl.load(x_tile, mask=row_ok[:, None] & (ks < left)[None, :], other=0.0)
        gate_sc, up_sc = gate_next, up_next
        gate_s += BLOCK_K // 32
        up_s += BLOCK_K // 32
        gate_next = _load_scales(gate_s, left - BLOCK_K, col_ok, BLOCK_K)
        up_next = _load_scales(up_s, left - BLOCK_K, col_ok, BLOCK_K)
        gate = _product(a, _load_codes(gate_q, left, col_ok, SCALED, BLOCK_K), gate_sc, gate, SCALED, FORMAT,
                        PRECISION, BLOCK_N, BLOCK_K)
        up = settled(_product(a, _load_codes(up_q, left, col_ok, SCALED, BLOCK_K), up_sc, up, SCALED, FORMAT,
                              PRECISION, BLOCK_N, BLOCK_K), SETTLE)
        x_tile += BLOCK_K
        gate_q += BLOCK_K // 2
        up_q += BLOCK_K // 2
    if BIAS:
        b_row = b_ptr + e * 2 * inter
        gate += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_row + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(gate, up, dtype, False, CLAMPED, alpha, limit)
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_down_kernel(a_ptr, q_ptr, s_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs,
                       hidden, inter, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PRECISION: tl.constexpr, SCALED: tl.constexpr, FORMAT: tl.constexpr, b_ptr=None,
                       BIAS: tl.constexpr = False, SETTLE: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, hidden,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    dtype = a_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    kg = tl.arange(0, BLOCK_K // 32)
    e = expert.to(tl.int64)
    a_tile = a_ptr + pairs[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_q = _codes_at(q_ptr + e * stride_qe, cols, stride_qn, SCALED, BLOCK_K)
    w_s = s_ptr + e * stride_se + cols[:, None] * stride_sn + kg[None, :]
    w_next = _load_scales(w_s, inter, col_ok, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        left = inter - k0
        a = tl.load(a_tile, mask=row_ok[:, None] & (ks < left)[None, :], other=0.0)
        w_sc = w_next
        w_s += BLOCK_K // 32
        w_next = _load_scales(w_s, left - BLOCK_K, col_ok, BLOCK_K)
        acc = settled(_product(a, _load_codes(w_q, left, col_ok, SCALED, BLOCK_K), w_sc, acc, SCALED, FORMAT,
                               PRECISION, BLOCK_N, BLOCK_K), SETTLE)
        a_tile += BLOCK_K
        w_q += BLOCK_K // 2
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
                    clamp: tuple[float, float] | None = None, kernel: str | None = None) -> torch.Tensor:
    """[T, H] -> [T, H], as ``triton_moe.fused_moe`` with MXFP4 experts: ``w13_q`` [E, 2I, H/2] / ``w13_s``
    [E, 2I, H/32] (gate rows then up rows), ``w2_q`` [E, H, I/2] / ``w2_s`` [E, H, I/32]; ``b13`` [E, 2I] and
    ``b2`` [E, H] the biases, ``clamp`` gpt-oss's ``(alpha, limit)``; ``kernel`` as ``mxfp4_kernel`` takes it."""
    _check_packed(w13_q, w13_s, "gate/up experts")
    _check_packed(w2_q, w2_s, "down experts")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13_q.shape
    inter = two_inter // 2
    if w13_q.shape[2] * 2 != hidden or w2_q.shape[1:] != (hidden, inter // 2):
        raise ValueError(f"MXFP4 experts {tuple(w13_q.shape)} / {tuple(w2_q.shape)} do not fit hidden size {hidden}")
    kernel = mxfp4_kernel(x.dtype, kernel, x.device)
    if kernel == "frag":  # converted on each call: tests and A/Bs; a model converts its experts once at load
        from llmcli.kernels.mxfp4_fragments import to_fragments
        from llmcli.kernels.triton_moe_mxfp4_frag import fused_moe_mxfp4_frag

        return fused_moe_mxfp4_frag(x, to_fragments(w13_q, w13_s, parts=2), to_fragments(w2_q, w2_s), topk_weights,
                                    topk_ids, tuning, b13=b13, b2=b2, clamp=clamp)
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    tuning = tuning or mxfp4_tuning(num_pairs, num_experts, kernel)
    x, w13_q, w13_s, w2_q, w2_s = (t.contiguous() for t in (x, w13_q, w13_s, w2_q, w2_s))
    pairs, experts, total, tiles_m, act, launch = grouped_launch(x, topk_ids, num_experts, inter, tuning)
    launch.update(SCALED=kernel == "scaled", FORMAT="fp16" if x.dtype == torch.float16 else "bf16",
                  SETTLE=x.is_cuda and kernel == "scaled")  # dequant feeds its MMAs from shared memory
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
