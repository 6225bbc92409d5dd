"""The fused MoE over MXFP4 experts in the ``frag`` layout (``mxfp4_fragments.py``): Hopper's form.

Each program computes a tile of an expert's output transposed, ``W [64 * WG rows, K] @ X[tokens, K]^T``, so the
4-bit weights are the warpgroup MMA's left operand, which it takes from registers: a thread loads its 16 bytes of
a 64 x 64 sub-tile (through shared memory, which Triton's pipeliner fills ahead asynchronously), turns each 4-byte
word into four bf16 pairs with a shift, a mask and one multiply by the scale each (a few more for the fourth),
and hands them to the MMA where they are: no value moves between threads, no 16-bit copy of a weight is stored
anywhere. The tokens are the MMA's narrow side (8 to 256 wide), so an expert holding 20 rows pads them to 32, not
to 64. ``triton_moe_mxfp4.py``'s ``scaled`` kernel, the one before, spends about twice the instructions a weight.

The conversion is inline PTX (``mul.bf16x2``: sm_90); Triton's interpreter, which runs the tests on CPU, cannot
run it, so ``EMULATE`` computes the same bits with integer operations into float32 (activations of float32 or
float16 there: the interpreter's bfloat16 dot is wrong). On a GPU the kernel takes bfloat16 activations only.

The routing and the tile walk are ``triton_moe.py``'s; the epilogues round where its kernels round. Each K step
ends with its MMAs settled (``triton_moe.settled``): Triton 3.6 would otherwise let the next step's unpacking
overwrite the registers of MMAs still in flight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmcli.kernels.mxfp4_fragments import CODE_BYTES, SCALE_BYTES, SUB, Mxfp4Fragments
from llmcli.kernels.triton_moe import MoeTuning, _tile, gated_activation, grouped_launch, settled

_CODE, _SCALE, _SUB = tl.constexpr(CODE_BYTES), tl.constexpr(SCALE_BYTES), tl.constexpr(SUB)


def _unpack_asm(wide: bool) -> str:
    """PTX: word $4 -> bf16x2 registers $0..$3 (p = 2 * (k >= 8) + row g + 8), times the bf16x2 multipliers
    $5 (rows g) and $7 (rows g + 8); $6 and $8 repeat them (the pack of four)."""
    scale = ["mul.bf16x2 v{i}, v{i}, bias;"] if wide else []
    lines = [".reg .b32 v<4>, u, bias;", "mov.b32 bias, 0x7E807E80;",  # 2^126 in both halves
             "and.b32 v0, $4, 0x81C081C0;",
             "shl.b32 u, $4, 3;", "and.b32 v1, u, 0x81C081C0;",
             "shl.b32 u, $4, 6;", "and.b32 v2, u, 0x81C081C0;",
             "shr.b32 u, $4, 6;", "and.b32 v3, u, 0x01800180;",
             "shr.b32 u, $4, 5;", "and.b32 u, u, 0x00400040;", "or.b32 v3, v3, u;",
             "shl.b32 u, $4, 5;", "and.b32 u, u, 0x80008000;", "or.b32 v3, v3, u;"]
    for i in range(4):
        lines += [s.format(i=i) for s in scale]
        lines.append(f"mul.bf16x2 ${i}, v{i}, {'$5' if i % 2 == 0 else '$7'};")
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_NARROW = tl.constexpr(_unpack_asm(False))
_ASM_WIDE = tl.constexpr(_unpack_asm(True))


@triton.jit
def _bf16_half(word, shift):
    """float32 of the bf16 in bits ``shift`` to ``shift + 15`` of uint32 ``word``."""
    return (((word >> shift) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _emulated(codes, mult, WIDE: tl.constexpr):
    """What ``_unpack_asm`` computes, in float32 with integer operations (Triton's interpreter)."""
    R: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    even, odd = tl.split(codes.to(tl.uint32).reshape(R, C // 4, 2, 2))  # element 2 * C1 + C0 of each word
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    m_even, _ = tl.split(mult.to(tl.uint32, bitcast=True).reshape(R, C // 4, 2, 2))
    row0, row8 = tl.split(m_even)
    scale0 = _bf16_half(row0, 0)
    scale8 = _bf16_half(row8, 0)
    v0 = word & 0x81C081C0
    v1 = (word << 3) & 0x81C081C0
    v2 = (word << 6) & 0x81C081C0
    v3 = ((word >> 6) & 0x01800180) | ((word >> 5) & 0x00400040) | ((word << 5) & 0x80008000)
    # register p = 2 J + C1 holds the k pair C0 = 0, 1 of row g + 8 C1 in output J
    r0 = tl.join(tl.join(_value(v0, 0, scale0, WIDE), _value(v1, 0, scale8, WIDE)),
                 tl.join(_value(v0, 16, scale0, WIDE), _value(v1, 16, scale8, WIDE)))  # [R, C/4, C1, C0]
    r1 = tl.join(tl.join(_value(v2, 0, scale0, WIDE), _value(v3, 0, scale8, WIDE)),
                 tl.join(_value(v2, 16, scale0, WIDE), _value(v3, 16, scale8, WIDE)))
    return r0.reshape(R, C), r1.reshape(R, C)


@triton.jit
def _value(v, shift, scale, WIDE: tl.constexpr):
    value = _bf16_half(v, shift)
    if WIDE:
        value = value * 8.507059173023462e37  # 2^126 first: 2^(scale - 1) need not fit
    return value * scale


@triton.jit
def _weights(q, s, kb, tiles_k, tile_ok, DTYPE: tl.constexpr, WG: tl.constexpr, BLOCK_K: tl.constexpr,
             WIDE: tl.constexpr, EMULATE: tl.constexpr, MASK_K: tl.constexpr):
    """The [64 * WG, BLOCK_K] left operand at sub-tile ``kb``: ``q`` / ``s`` point at sub-tile 0 of each
    thread's codes [128 * WG, BLOCK_K / 4] and scales [128 * WG, BLOCK_K / 16]. ``MASK_K``: the step reaches
    past the last sub-tile; ``tile_ok``: which threads' row tiles exist (all but past the last, with WG > 1)."""
    R: tl.constexpr = 128 * WG
    C: tl.constexpr = BLOCK_K // 4
    NG: tl.constexpr = BLOCK_K // 32
    if MASK_K:
        sub_c = kb + tl.arange(0, C) // 16
        codes = tl.load(q + kb * _CODE, mask=tile_ok[:, None] & (sub_c < tiles_k)[None, :], other=0)
        sub_s = kb + tl.arange(0, BLOCK_K // 16) // 4
        sc = tl.load(s + kb * _SCALE, mask=tile_ok[:, None] & (sub_s < tiles_k)[None, :], other=127)
    elif WG > 1:
        codes = tl.load(q + kb * _CODE, mask=tile_ok[:, None], other=0)
        sc = tl.load(s + kb * _SCALE, mask=tile_ok[:, None], other=127)
    else:  # the steps before the last: no predicate on the copies
        codes = tl.load(q + kb * _CODE)
        sc = tl.load(s + kb * _SCALE)
    if WIDE:
        mult = sc.to(tl.int32) << 7  # 2^(scale - 127); the codes take 2^126 apart
    else:
        mult = (sc.to(tl.int32) + 126) << 7  # 2^(scale - 1): 2^(scale - 127) and the codes' 2^126 in one
    mult = mult | (mult << 16)
    # scale byte 2 * group + r8 -> word 2 * group + (0, 1), element (C0, C1 = r8) of its pack of four
    mult = tl.broadcast_to(mult.reshape(R, NG, 1, 2, 1), (R, NG, 2, 2, 2)).reshape(R, C)
    if EMULATE:
        r0, r1 = _emulated(codes, mult, WIDE)
    else:
        r0, r1 = tl.inline_asm_elementwise(_ASM_WIDE if WIDE else _ASM_NARROW, "=r,=r,=r,=r,r,r,r,r,r",
                                           [codes, mult], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    # [thread (ww = 4 wg + w, g, c), word W, C1, C0, J] -> row 16 ww + 8 C1 + g, k 16 W + 8 J + 2 c + C0
    w = tl.join(r0, r1).reshape(4 * WG, 8, 4, BLOCK_K // 16, 2, 2, 2)
    return w.permute(0, 4, 1, 3, 6, 2, 5).reshape(64 * WG, BLOCK_K).to(DTYPE)


@triton.jit
def _operand_ptrs(q_ptr, s_ptr, expert, tile, tiles_k, stride_qe, stride_se, WG: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Each thread's code and scale pointers at sub-tile 0 of 64-row tile ``tile + wg`` (its warpgroup's)."""
    t = tl.arange(0, 128 * WG)
    row_tile = tile + t // 128
    c = tl.arange(0, BLOCK_K // 4)
    b = tl.arange(0, BLOCK_K // 16)
    e = expert.to(tl.int64)
    q = q_ptr + e * stride_qe + (row_tile * tiles_k * _CODE + (t % 128) * 16)[:, None] \
        + ((c // 16) * _CODE + c % 16)[None, :]
    s = s_ptr + e * stride_se + (row_tile * tiles_k * _SCALE + (t % 128) * 4)[:, None] \
        + ((b // 4) * _SCALE + b % 4)[None, :]
    return q, s, row_tile


@triton.jit
def _activations(tile, k0, k, row_ok, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """The right operand: rows ``tile`` [BLOCK_M, BLOCK_K] from input ``k0`` on, transposed."""
    if MASK_K:
        rows = tl.load(tile + k0, mask=row_ok[:, None] & (tl.arange(0, BLOCK_K) < k - k0)[None, :], other=0.0)
    else:
        rows = tl.load(tile + k0, mask=row_ok[:, None], other=0.0)
    return tl.trans(rows)


@triton.jit
def _gate_up_step(x_tile, k0, hidden, row_ok, gate_q, gate_s, up_q, up_s, tiles_k, tile_ok, gate, up,
                  DTYPE: tl.constexpr, WG: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr,
                  EMULATE: tl.constexpr, MASK_K: tl.constexpr, SETTLE: tl.constexpr):
    xt = _activations(x_tile, k0, hidden, row_ok, BLOCK_K, MASK_K)
    kb = k0 // _SUB
    gate = tl.dot(_weights(gate_q, gate_s, kb, tiles_k, tile_ok, DTYPE, WG, BLOCK_K, WIDE, EMULATE, MASK_K), xt,
                  gate)
    up = tl.dot(_weights(up_q, up_s, kb, tiles_k, tile_ok, DTYPE, WG, BLOCK_K, WIDE, EMULATE, MASK_K), xt, up)
    return gate, settled(up, SETTLE)


@triton.jit
def _down_step(a_tile, k0, inter, row_ok, w_q, w_s, tiles_k, tile_ok, acc, DTYPE: tl.constexpr, WG: tl.constexpr,
               BLOCK_K: tl.constexpr, WIDE: tl.constexpr, EMULATE: tl.constexpr, MASK_K: tl.constexpr,
               SETTLE: tl.constexpr):
    at = _activations(a_tile, k0, inter, row_ok, BLOCK_K, MASK_K)
    return settled(tl.dot(_weights(w_q, w_s, k0 // _SUB, tiles_k, tile_ok, DTYPE, WG, BLOCK_K, WIDE, EMULATE,
                                    MASK_K), at, acc), SETTLE)


@triton.jit(do_not_specialize=["num_pairs"])
def _frag_gate_up_kernel(x_ptr, q_ptr, s_ptr, out_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, inter, hidden,
                         tiles_n, tiles_k, stride_xm, stride_qe, stride_se, stride_om,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, WG: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, WIDE: tl.constexpr, EMULATE: tl.constexpr, b_ptr=None,
                         BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False, alpha=1.0, limit=0.0,
                         SETTLE: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, inter,
                                                      BLOCK_M, 64 * WG, GROUP_M)
    if not live:
        return
    dtype = x_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * stride_xm + ks[None, :]
    first_tile = tl.min(cols, 0) // 64  # this program's first 64-row tile
    gate_q, gate_s, row_tile = _operand_ptrs(q_ptr, s_ptr, expert, first_tile, tiles_k, stride_qe, stride_se, WG,
                                             BLOCK_K)
    up_q = gate_q + tiles_n * tiles_k * _CODE
    up_s = gate_s + tiles_n * tiles_k * _SCALE
    tile_ok = row_tile < tiles_n
    gate = tl.zeros((64 * WG, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((64 * WG, BLOCK_M), dtype=tl.float32)
    whole = hidden - hidden % BLOCK_K  # steps inside K, then one reaching past it
    for k0 in range(0, whole, BLOCK_K):
        gate, up = _gate_up_step(x_tile, k0, hidden, row_ok, gate_q, gate_s, up_q, up_s, tiles_k, tile_ok, gate, up,
                                 dtype, WG, BLOCK_K, WIDE, EMULATE, False, SETTLE)
    if whole < hidden:
        gate, up = _gate_up_step(x_tile, whole, hidden, row_ok, gate_q, gate_s, up_q, up_s, tiles_k, tile_ok, gate,
                                 up, dtype, WG, BLOCK_K, WIDE, EMULATE, True, SETTLE)
    e = expert.to(tl.int64)
    if BIAS:
        gate += tl.load(b_ptr + e * 2 * inter + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        up += tl.load(b_ptr + e * 2 * inter + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    act = gated_activation(gate, up, dtype, False, CLAMPED, alpha, limit)
    out = out_ptr + pairs[None, :].to(tl.int64) * stride_om + cols[:, None]
    tl.store(out, act.to(dtype), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _frag_down_kernel(a_ptr, q_ptr, s_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs,
                      hidden, inter, tiles_n, tiles_k, stride_am, stride_qe, stride_se, stride_om,
                      BLOCK_M: tl.constexpr, WG: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      WIDE: tl.constexpr, EMULATE: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False,
                      SETTLE: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, hidden,
                                                      BLOCK_M, 64 * WG, GROUP_M)
    if not live:
        return
    dtype = a_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + pairs[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_q, w_s, row_tile = _operand_ptrs(q_ptr, s_ptr, expert, tl.min(cols, 0) // 64, tiles_k, stride_qe,
                                       stride_se, WG, BLOCK_K)
    tile_ok = row_tile < tiles_n
    acc = tl.zeros((64 * WG, BLOCK_M), dtype=tl.float32)
    whole = inter - inter % BLOCK_K
    for k0 in range(0, whole, BLOCK_K):
        acc = _down_step(a_tile, k0, inter, row_ok, w_q, w_s, tiles_k, tile_ok, acc, dtype, WG, BLOCK_K, WIDE,
                         EMULATE, False, SETTLE)
    if whole < inter:
        acc = _down_step(a_tile, whole, inter, row_ok, w_q, w_s, tiles_k, tile_ok, acc, dtype, WG, BLOCK_K, WIDE,
                         EMULATE, True, SETTLE)
    if BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    acc = acc.to(dtype).to(tl.float32) * weight[None, :]
    out = out_ptr + pairs[None, :].to(tl.int64) * stride_om + cols[:, None]
    tl.store(out, acc.to(dtype), mask=col_ok[:, None] & row_ok[None, :])


def frag_tuning(num_pairs: int, num_experts: int) -> MoeTuning:
    """``block_m`` tokens (the MMA's narrow side: an expert's rows padded to it), ``block_n`` weight rows (64 a
    warpgroup), ``block_k`` inputs a step (whole 64-value sub-tiles). Measured on an H200 at gpt-oss-20b's shapes
    (benchmarks/RESULTS.md, 2026-12-05 T2b): below one row an expert the fewest, deepest steps; up to 16 rows two
    warpgroups on 16 tokens (16 and 64 tokens: 190 us against 239-257 for one warpgroup and 248-255 for
    ``scaled``); up to 64 rows four warpgroups on 64 tokens (256 tokens: 275 us against 394 for ``scaled``), each
    program reading its tokens' activations once for 256 weight rows; past that one warpgroup on 128 tokens (1,024
    tokens: 616 us against 693 for four warpgroups and 1,000 for ``scaled``)."""
    per_expert = num_pairs / num_experts
    if per_expert < 1:
        return MoeTuning(block_m=16, block_n=64, block_k=256, num_warps=4)
    if per_expert <= 16:
        return MoeTuning(block_m=16, block_n=128, block_k=64, num_warps=8)
    if per_expert <= 64:
        return MoeTuning(block_m=64, block_n=256, block_k=64, num_warps=16)
    return MoeTuning(block_m=128, block_n=64, block_k=64, num_warps=4)


def check_frag_tuning(tuning: MoeTuning) -> None:
    def power_of_two(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if tuning.block_n % 64 or tuning.num_warps != tuning.block_n // 16 or tuning.block_k < SUB \
            or not (power_of_two(tuning.block_k) and power_of_two(tuning.block_n) and power_of_two(tuning.block_m)) \
            or tuning.block_m < 16:
        raise ValueError(f"frag tiles {tuning}: block_n 64, 128 or 256 (4 warps each 64), block_k 64, 128 or 256, "
                         "block_m a power of two from 16")
    # The next two were measured wrong on an H200 before each K step's MMAs were settled (triton_moe.settled):
    # 128 x 128 x 64 (relative error 0.014 at 1,024 tokens) and 64 x 128 x 64 (0.0016-0.0023 at 256 and 1,024
    # tokens, inf at 4,096, where every other tile gave under 0.0002). Their builds had MMA operand registers
    # overwritten in flight, like every tile's then; refused until the GPU shows them right settled
    # (tests/test_gpu_moe_mxfp4_speed.py runs them unchecked).
    if tuning.block_n > 64 and tuning.block_m > 64:
        raise ValueError(f"frag tiles {tuning}: two warpgroups or more take at most 64 tokens (block_m)")
    if (tuning.block_m, tuning.block_n, tuning.block_k) == (64, 128, 64):
        raise ValueError(f"frag tiles {tuning}: 64 x 128 x 64 gave wrong sums on Hopper (take 64 x 256 x 64)")


def fused_moe_mxfp4_frag(x: torch.Tensor, w13: Mxfp4Fragments, w2: Mxfp4Fragments, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, tuning: MoeTuning | None = None, b13: torch.Tensor | None = None,
                         b2: torch.Tensor | None = None, clamp: tuple[float, float] | None = None,
                         settle: bool = True) -> torch.Tensor:
    """[T, H] -> [T, H], as ``triton_moe_mxfp4.fused_moe_mxfp4`` with its experts in the ``frag`` layout:
    ``w13`` gate rows then up rows (two parts), ``w2`` the down projection. ``settle=False`` lets a step's MMAs
    run on into the next step as Triton pipelines them (``triton_moe.settled`` says why that is wrong): for
    measuring what settling costs only."""
    num_tokens, hidden = x.shape
    inter = w13.rows
    if w13.parts != 2 or w13.cols != hidden or w2.parts != 1 or (w2.rows, w2.cols) != (hidden, inter):
        raise ValueError(f"MXFP4 fragments {w13.parts} x {w13.rows} x {w13.cols} / {w2.parts} x {w2.rows} x "
                         f"{w2.cols} do not fit hidden size {hidden}")
    emulate = x.device.type != "cuda"
    if not emulate and x.dtype != torch.bfloat16:
        raise ValueError(f"the frag MXFP4 kernel takes bfloat16 activations on a GPU, not {x.dtype}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    tuning = tuning or frag_tuning(num_pairs, w13.num_experts)
    check_frag_tuning(tuning)
    x = x.contiguous()
    pairs, experts, total, tiles_m, act, launch = grouped_launch(x, topk_ids, w13.num_experts, inter, tuning)
    wg = tuning.block_n // 64
    common = dict(BLOCK_M=tuning.block_m, WG=wg, BLOCK_K=tuning.block_k, GROUP_M=tuning.group_m,
                  num_warps=tuning.num_warps, num_stages=tuning.num_stages, EMULATE=emulate,
                  SETTLE=settle and not emulate)
    _frag_gate_up_kernel[(tiles_m * triton.cdiv(inter, tuning.block_n),)](
        x, w13.codes, w13.scales, act, pairs, experts, total, num_pairs, inter, hidden, w13.tiles_n, w13.tiles_k,
        x.stride(0), w13.codes.stride(0), w13.scales.stride(0), act.stride(0), TOP_K=top_k, WIDE=w13.wide,
        b_ptr=None if b13 is None else b13.contiguous(), BIAS=b13 is not None, CLAMPED=clamp is not None,
        alpha=float(clamp[0]) if clamp else 1.0, limit=float(clamp[1]) if clamp else 0.0, **common)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _frag_down_kernel[(tiles_m * triton.cdiv(hidden, tuning.block_n),)](
        act, w2.codes, w2.scales, down, topk_weights.float().contiguous(), pairs, experts, total, num_pairs, hidden,
        inter, w2.tiles_n, w2.tiles_k, act.stride(0), w2.codes.stride(0), w2.scales.stride(0), down.stride(0),
        WIDE=w2.wide, b_ptr=None if b2 is None else b2.contiguous(), BIAS=b2 is not None, **common)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
