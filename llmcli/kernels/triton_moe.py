"""Fused mixture-of-experts on the GPU: tokens grouped by expert, then two grouped GEMMs in Triton.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes what ``kernels/moe_reference.moe_reference`` does:

1. ``align_by_expert``: the T*k (token, slot) pairs grouped by expert id, each expert's run padded to a multiple
   of ``block_m`` so that a row tile never mixes experts; ``expert_of_tile`` names each tile's expert (-1: past
   the end). One kernel on the device with fixed shapes (the padded length is at most ``T*k + E*(block_m-1)``),
   so nothing waits for the host and CUDA graphs capture it; experts without tokens get no tiles.
2. gate/up: per tile, rows of ``x`` gathered by token times the tile's expert's gate and up rows, two float32
   accumulators side by side, SiLU(gate) * up written as one [T*k, I] intermediate (the [T*k, 2I] projection
   is never stored).
3. down: the intermediate's rows times the expert's down projection, scaled by the pair's routing weight in
   the epilogue, written to [T*k, H]; a token's k rows are then summed (a fixed order: deterministic).

gpt-oss's experts add a bias to each projection (``b13`` [E, 2I], ``b2`` [E, H]) and use the clamped SwiGLU
(``clamp=(alpha, limit)``: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``);
Gemma 4's use GeGLU (``gelu``: tanh-GELU in place of SiLU). Biases go with either activation; the clamp is a
SwiGLU's, so ``gelu`` with ``clamp`` is refused. All constexpr switches, so the Qwen-style call compiles the kernels
it always did.

Same plan as vLLM's fused_moe (moe_align_block_size + one grouped kernel), written for llmcli.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmcli.kernels.moe_reference import check_activation


@dataclass(frozen=True)
class MoeTuning:
    """Tile sizes of the grouped GEMMs; ``block_m`` also the padding of each expert's run of rows."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def pick_tuning(num_pairs: int, num_experts: int) -> MoeTuning:
    """Small row tiles when each expert sees few rows (decode: padding is wasted work), larger for prefill."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return MoeTuning(block_m=16)
    if per_expert <= 64:
        return MoeTuning(block_m=32)
    return MoeTuning(block_m=64, block_n=128, num_warps=8)  # two 64x128 float32 accumulators


# the pair count changes every step: one compiled variant for all of them (not one per divisibility by 16)
@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _align_kernel(ids_ptr, pairs_ptr, experts_ptr, total_ptr, cursor_ptr, num_pairs, num_experts, capacity,
                  BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    # One program: a histogram of the expert ids, its padded prefix sum, then each pair placed in its expert's
    # run by an atomic cursor. Where in its run a pair lands varies between runs; the results do not, as every
    # row of the grouped GEMMs is computed on its own and a token's k rows are summed in slot order.
    bins = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)  # past the end: a spare bin
        counts += tl.histogram(ids.to(tl.int32), EXPERTS_P2)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.atomic_xchg(cursor_ptr + bins, ends - padded)  # at L2, where the cursors' atomic_adds below go
    tl.store(total_ptr, total)
    for start in range(0, capacity // BLOCK_M, TILE_CHUNK):
        tiles = start + tl.arange(0, TILE_CHUNK)
        rows = tiles * BLOCK_M
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)  # runs ending at or before it
        tl.store(experts_ptr + tiles, tl.where(rows < total, expert, -1), mask=rows < capacity)
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=offs < capacity)
    tl.debug_barrier()  # the cursors and the sentinel fill before any pair is placed
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
        tl.store(pairs_ptr + slot, offs, mask=ok)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [P], expert_of_tile [P / block_m], padded_total [1])`` for ``topk_ids`` [T, k].

    ``sorted_pairs`` holds flat pair indices ``t*k + j`` grouped by expert, each group padded with the
    sentinel ``T*k`` to a multiple of ``block_m``; ``P = T*k + E*(block_m-1)`` rounded up to ``block_m``.
    One kernel launch (a small one-program kernel: decode steps launch it once per layer).
    """
    flat = topk_ids.flatten().contiguous()
    n = flat.numel()
    device = flat.device
    capacity = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    experts_p2 = triton.next_power_of_2(num_experts + 1)  # + the spare bin of the masked loads
    pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    tile_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(experts_p2, dtype=torch.int32, device=device)
    _align_kernel[(1,)](flat, pairs, tile_expert, total, cursor, n, num_experts, capacity, BLOCK_M=block_m,
                        EXPERTS_P2=experts_p2, CHUNK=1024, TILE_CHUNK=max(16, 8192 // experts_p2), num_warps=8)
    return pairs, tile_expert, total


@triton.jit
def _tile_ids(pid, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles walk the same weight tiles one after another, so the weights stay in L2.
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_M: tl.constexpr):
    """This program's output tile: whether it holds any pair (tiles past the padded total, or of no expert, do
    nothing), its expert, its rows' pair indices and which are real, its columns and which are in range."""
    num_tiles_n = tl.cdiv(num_cols, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.num_programs(0) // num_tiles_n, num_tiles_n, GROUP_M)
    expert = tl.load(experts_ptr + pid_m)
    live = (pid_m * BLOCK_M < tl.load(total_ptr)) & (expert >= 0)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return live, expert, pairs, pairs < num_pairs, cols, cols < num_cols


@triton.jit
def settled(acc, SETTLE: tl.constexpr):
    """``acc`` read back through a register move, so that this K step's tensor-core MMAs finish before the next
    step begins (SETTLE; a no-op otherwise, and on Triton's interpreter, which runs no PTX).

    Where a dot's left operand sits in registers (the MXFP4 kernels' unpacked weights or loaded activations),
    Triton 3.6 lets a step's warpgroup MMAs run on into the next step, waiting only for the oldest, and the next
    step's instructions may then reuse registers those MMAs have not read yet: undefined behaviour by the PTX
    manual (triton-lang/triton#9433), visible in the built SASS (tests/sass_loops.py finds it). Reading
    the accumulator in the loop makes Triton wait for all of them first."""
    if SETTLE:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)
    return acc


@triton.jit
def gated_activation(gate, up, dtype, GELU: tl.constexpr, CLAMPED: tl.constexpr, alpha, limit):
    """The experts' activation of float32 gate/up accumulators (every fused MoE kernel's gate/up epilogue),
    rounded where the eager activation over a stored projection rounds: gate, up, then SiLU (GELU: its tanh form,
    Gemma 4's experts: 0.5 g (1 + tanh(y)) = g sigmoid(2y)); ``CLAMPED``: gpt-oss's clamped SwiGLU."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        if GELU:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            gated = gate * tl.sigmoid(2.0 * inner)
        else:
            gated = gate * tl.sigmoid(gate)
        act = gated.to(dtype).to(tl.float32) * up
    return act


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, inter, hidden,
                        stride_xm, stride_we, stride_wn, stride_om,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False,
                        GELU: tl.constexpr = False, CLAMPED: tl.constexpr = False, alpha=1.0, limit=0.0):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, inter,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    tokens = pairs // TOP_K
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_tile = w_base + cols[None, :] * stride_wn + ks[:, None]
    up_tile = gate_tile + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(gate_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(up_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        gate = tl.dot(a, g, gate, input_precision=PRECISION)
        up = tl.dot(a, u, up, input_precision=PRECISION)
        x_tile += BLOCK_K
        gate_tile += BLOCK_K
        up_tile += BLOCK_K
    if BIAS:
        b_row = b_ptr + expert.to(tl.int64) * 2 * inter
        gate += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_row + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(gate, up, out_ptr.dtype.element_ty, GELU, CLAMPED, alpha, limit)
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, hidden,
                     inter, stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr, b_ptr=None, BIAS: tl.constexpr = False):
    live, expert, pairs, row_ok, cols, col_ok = _tile(pairs_ptr, experts_ptr, total_ptr, num_pairs, hidden,
                                                      BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + pairs[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_tile = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    if BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # the routing weight in float32 on the float32 sum, rounded once
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_launch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, inter: int, tuning: MoeTuning):
    """What both grouped GEMMs of a fused MoE call share: the (token, expert) pairs sorted by expert in tiles of
    ``block_m`` (and the tiles' count), the activation buffer between the GEMMs, the launch settings."""
    pairs, experts, total = align_by_expert(topk_ids, num_experts, tuning.block_m)
    act = torch.empty(topk_ids.numel(), inter, dtype=x.dtype, device=x.device)
    launch = dict(BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n, BLOCK_K=tuning.block_k, GROUP_M=tuning.group_m,
                  num_warps=tuning.num_warps, num_stages=tuning.num_stages,
                  # float32 weights mean a check against the reference: no TF32 rounding then
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return pairs, experts, total, pairs.numel() // tuning.block_m, act, launch


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tuning: MoeTuning | None = None, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, gelu: bool = False,
              clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """[T, H] -> [T, H]: each token through its ``k`` experts of ``w13`` [E, 2I, H] / ``w2`` [E, H, I], weighted.
    ``b13`` / ``b2``: the projections' biases; ``gelu``: GeGLU experts (tanh GELU) instead of SwiGLU; ``clamp``:
    ``(alpha, limit)`` of gpt-oss's clamped SwiGLU (the switches as ``moe_reference`` takes them)."""
    check_activation(gelu, clamp)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    tuning = tuning or pick_tuning(num_pairs, num_experts)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, experts, total, tiles_m, act, launch = grouped_launch(x, topk_ids, num_experts, inter, tuning)
    _moe_gate_up_kernel[(tiles_m * triton.cdiv(inter, tuning.block_n),)](
        x, w13, act, pairs, experts, total, num_pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        b_ptr=None if b13 is None else b13.contiguous(), BIAS=b13 is not None, GELU=gelu, CLAMPED=clamp is not None,
        alpha=float(clamp[0]) if clamp else 1.0, limit=float(clamp[1]) if clamp else 0.0, **launch)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(tiles_m * triton.cdiv(hidden, tuning.block_n),)](
        act, w2, down, topk_weights.float().contiguous(), pairs, experts, total, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), down.stride(0),
        b_ptr=None if b2 is None else b2.contiguous(), BIAS=b2 is not None, **launch)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
