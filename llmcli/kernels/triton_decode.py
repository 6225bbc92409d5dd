"""Paged decode attention in Triton: one query token per sequence, split-KV (flash-decoding).

Grid ``(batch, num_kv_heads, num_splits)``. One program serves every query head
of one KV head (the GQA group, padded to 16 rows so ``tl.dot`` can use the
tensor cores), so each cached K/V byte is read once per step. A sequence's
context is cut into ``num_splits`` partitions of whole ``BLOCK_N`` tiles; each
program runs an online softmax over its partition. With one split it writes the
output directly. With more, each writes a partial result (normalised output plus
base-2 log-sum-exp) and a second, small reduce kernel combines them
(``_combine_head``): each split's partial sits at its split index in one
fixed-width tile, reduced by the same tree whatever the split count, so outputs
are deterministic. (Combining in the partition kernel instead, by the last split
program to arrive, saves that launch but measured slower at batches <= 64:
benchmarks/RESULTS.md run 23.)

The partition size is computed inside the kernel from the row's own context
length, so the launch depends only on the batch size and ``num_splits`` (host
ints fixed for a captured CUDA graph), never on values read back from the GPU.
Rows with context length 0 (graph padding) read nothing and write zeros.

An FP8 cache is read as it is stored (half the bytes of bf16) and widened to q's dtype for the dots; its
scales need no per-element work: ``k_scale`` is folded into the softmax scale and ``v_scale`` into the output.

Launch order: the grid runs a row's KV heads side by side (``DecodeTuning.heads_fastest``), rows in the
order of ``row_order`` when given. The engine passes its rows longest context first, so the GPU's block
scheduler starts the longest programs first and fills in with short ones (longest-processing-time-first
packing): on contexts of spread lengths 7-12% faster at batch 96-256 than rows as they come, and faster than
the same bytes in equal rows (benchmarks/RESULTS.md run 45). The outputs do not depend on the order.
(A minimum of tiles per split, so that short rows of a spread batch skip the splits long rows need, gained
4-8% on batches of 64-128 rows and less than the launch order: measured in run 44 and removed.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


BLOCK_N = 64  # keys per tile: 64 x 128 bf16 = 16 KiB per K (and V) tile
MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16
MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost outweighs the parallelism it adds
PROGRAMS_PER_SM = 4  # split until about this many programs per SM
MAX_SPLITS = 64  # a power of two: the combine reads every split's partial as one tile this wide
NUM_WARPS = 4
# Software pipelining of the K/V tile loads (cp.async on Hopper). The block-table entry is loaded one stage
# before its tile, so 3 stages keep one K/V tile in flight per program and 5 keep two (72 KiB of shared memory at
# 64 x 128 bf16). 5 measured faster end to end on every model tried (benchmarks/RESULTS.md, calls F2, G2-G4:
# Qwen2.5-0.5B +6.6%, Qwen2.5-7B +0.5-0.7%, Qwen3-0.6B +0.3-0.5%, Qwen3-8B +0.0-0.4%, with the split rule below);
# an FP8 cache keeps the 3 it was measured with.
NUM_STAGES = 5
FP8_NUM_STAGES = 3


@dataclass(frozen=True)
class DecodeTuning:
    """Launch settings of the decode kernel; the defaults are the module constants (benchmarks sweep others)."""

    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    heads_fastest: bool = True  # grid (kv heads, rows, splits): a row's heads side by side, rows in row_order


DEFAULT_TUNING = DecodeTuning()
# head_dim 256: half the keys per tile keep a tile's bytes (and the registers of its dots) those of 64 x 128. Compiled
# for sm_90 by Triton 3.9: 216 registers a thread and no spills, where 64-key tiles take 255 and spill.
HEAD256_TUNING = DecodeTuning(block_n=32)
# head_dim 512 (Gemma 4's global layers): 16-key tiles, the same bytes again; sm_90, Triton 3.9: 220 registers, no
# spills, 32 KiB of shared memory (32-key tiles spill at 4 warps).
HEAD512_TUNING = DecodeTuning(block_n=16)


def default_tuning(head_dim: int) -> DecodeTuning:
    """The launch settings for a model of ``head_dim``."""
    if head_dim > 256:
        return HEAD512_TUNING
    return HEAD256_TUNING if head_dim > 128 else DEFAULT_TUNING


@triton.jit
def _combine_head(part_out_ptr, part_lse_ptr, rows, mask_s, dst, HEAD_DIM: tl.constexpr, sink=0.0,
                  SINK: tl.constexpr = False):
    """Combine one head's partials (rows ``rows`` where ``mask_s``) into ``dst``; with ``SINK`` the head's sink
    logit (exp2 units) joins the denominator.

    One fixed-width tile of every split (MAX_SPLITS wide whatever the count, so the reduction
    tree, and with it the rounding, never depends on the count), loaded in one round trip.
    ``.cg`` loads read L2, never a stale L1 line left by an earlier step on this SM.
    """
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + rows, mask=mask_s, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=mask_s[:, None], other=0.0,
                   cache_modifier=".cg")
    top = tl.max(lse, 0)
    if SINK:
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: weights become 0, not NaN
    w = tl.exp2(lse - top)
    denom = tl.sum(w, 0)
    if SINK:
        denom += tl.exp2(sink - top)
    o = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(dst + d, o.to(dst.dtype.element_ty))


# Table width and split count change from step to step: without do_not_specialize Triton would
# compile a new kernel whenever one of them becomes 1 or a multiple of 16.
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ob, stride_oh,
    scale_log2, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HEADS_FASTEST: tl.constexpr = False, row_order_ptr=None, v_scale=1.0, FP8: tl.constexpr = False,
    window=0, WINDOWED: tl.constexpr = False, sinks_ptr=None, SINKS: tl.constexpr = False,
):
    if HEADS_FASTEST:  # a row's KV heads are launched together, rows in the order row_order gives
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    if row_order_ptr is not None:
        b = tl.load(row_order_ptr + b)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    if WINDOWED:
        # the query (position ctx - 1) sees keys lo .. ctx - 1: the splits share the tiles from lo's on, the
        # tiles before it are never read (their cache blocks may be gone)
        lo = tl.maximum(ctx - window, 0)
        first = (lo // BLOCK_N) * BLOCK_N
    else:
        first = 0
    # Whole tiles per split, derived from this row's own length (balanced per row).
    num_tiles = tl.cdiv(ctx - first, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    mask_g = g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=mask_g[:, None], other=0.0)
    if not FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kch
    v_head = v_cache_ptr + kvh * stride_vch
    offs = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs
        mask_n = pos < end
        if WINDOWED:
            mask_n = mask_n & (pos >= lo)
        if BLOCK_SIZE % BLOCK_N == 0:
            # the tile sits inside one cache block: one table lookup
            blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
            k_rows = blk * stride_kcb + (pos % BLOCK_SIZE) * stride_kcs
            v_rows = blk * stride_vcb + (pos % BLOCK_SIZE) * stride_vcs
        else:
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            k_rows = blk * stride_kcb + (pos % BLOCK_SIZE) * stride_kcs
            v_rows = blk * stride_vcb + (pos % BLOCK_SIZE) * stride_vcs
        k = tl.load(k_head + k_rows[:, None] + d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_head + v_rows[:, None] + d[None, :], mask=mask_n[:, None], other=0.0)
        if FP8:  # every e4m3 value is exact in 16 bits
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SINKS and not SPLIT:  # split: the combine adds the sink once, not every partition
        sink = tl.load(sinks_ptr + heads, mask=mask_g, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        corr = tl.exp2(m_i - m_fin)
        l_i = l_i * corr + tl.exp2(sink - m_fin)
        acc = acc * corr[:, None]
    # Empty partition (or context 0): l == 0, output 0 and lse -inf, never NaN.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if FP8:
        o = o * v_scale
    dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = (b * (GROUP * num_kv_heads) + heads).to(tl.int64) * num_splits
        tl.store(part_lse_ptr + rows + split, lse, mask=mask_g)
        tl.store(part_out_ptr + (rows + split)[:, None] * HEAD_DIM + d[None, :], o, mask=mask_g[:, None])
    else:
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, MAX_SPLITS_PAD: tl.constexpr, sinks_ptr=None, SINKS: tl.constexpr = False,
):
    """Combines the split partials: grid (batch, num_heads), one head's partials per program."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS_PAD)
    rows = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits + s
    sink = 0.0
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    _combine_head(part_out_ptr, part_lse_ptr, rows, s < num_splits,
                  out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh, HEAD_DIM, sink, SINKS)


def choose_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int = 132, *,
                      programs_per_sm: int = PROGRAMS_PER_SM, min_tokens: int = MIN_TOKENS_PER_SPLIT) -> int:
    """How many partitions to cut each context into, from host-side sizes only.

    With fewer (row, KV head) programs than SMs some SMs would idle, so split until there are
    about ``programs_per_sm`` per SM, but never give a split fewer than ``min_tokens`` keys of the
    longest context. (Measured on an H200 at Qwen3-0.6B shapes: batch 1 x 8k keys goes from 0.16
    to 2.2 TB/s with 64 splits.) With at least one program per SM, no split: splitting there cut
    each context into a few tiles a program plus a reduce, and a model with few KV heads (4:
    Qwen2.5-7B, batches 33-98) paid it on every layer (calls F1-F2: 49 against 31 us a layer at
    batch 96 with 5 stages). A decode graph is captured before any context is known, for the table
    width (max_model_len keys), so there only the programs-per-SM bound applies; rows shorter than
    that leave some splits empty.
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = triton.cdiv(programs_per_sm * num_sms, programs)
    useful = max(1, max_seqlen_k // min_tokens)
    return max(1, min(wanted, useful, MAX_SPLITS))


def decode_stages(tuning: DecodeTuning, cache_dtype: torch.dtype) -> int:
    """The pipeline depth a launch over a cache of ``cache_dtype`` gets."""
    if cache_dtype == torch.float8_e4m3fn:
        return min(tuning.num_stages, FP8_NUM_STAGES)
    return tuning.num_stages if torch.finfo(cache_dtype).bits <= 16 else 2  # float32 (tests): 2


def scratch_numel(batch: int, num_heads: int, head_dim: int, num_splits: int) -> tuple[int, int]:
    """Elements of the float32 (partial outputs, partial lse) scratch a split launch needs."""
    if num_splits <= 1:
        return 0, 0
    rows = batch * num_heads * num_splits
    return rows * head_dim, rows


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int = 1,
    part_out: torch.Tensor | None = None, part_lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None, tuning: DecodeTuning | None = None,
    row_order: torch.Tensor | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [batch, num_heads, head_dim] over each row's cached context.

    ``part_out``/``part_lse`` are flat float32 scratch buffers of at least
    ``scratch_numel(...)`` elements (needed when ``num_splits > 1``; pass
    preallocated ones under CUDA graphs). ``row_order`` (integer [batch], a permutation of the
    rows, with ``tuning.heads_fastest``) is the order the rows' programs are launched in: longest
    first lets the GPU's block scheduler pack spread contexts (the outputs do not depend on it).
    ``kv_scales``: the (k, v) scales of an FP8 cache. ``tuning``: the launch settings (None: ``default_tuning``).
    ``window``: the query sees only the last ``window`` keys of its row; the tiles before them are skipped, so a
    context many windows long costs only the window (``num_splits`` can be chosen for the window's length).
    ``sinks`` [num_heads] float32: per-head sink logits in each softmax's denominator (None: none).
    """
    batch, num_heads, head_dim = q.shape
    tuning = tuning or default_tuning(head_dim)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, got {window}")
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_contiguous(), "sinks: one logit per query head"
    group = num_heads // num_kv_heads
    group_pad = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
    split = num_splits > 1
    assert num_splits <= MAX_SPLITS, f"at most {MAX_SPLITS} splits (the combine's fixed tile width)"
    if split:
        n_out, n_lse = scratch_numel(batch, num_heads, head_dim, num_splits)
        if part_out is None or part_lse is None:
            part_out = torch.empty(n_out, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(n_lse, dtype=torch.float32, device=q.device)
        assert part_out.numel() >= n_out and part_lse.numel() >= n_lse, "scratch too small"
    else:
        part_out = part_lse = out  # unused by the kernel
    assert row_order is None or tuning.heads_fastest, "row_order needs tuning.heads_fastest"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    grid = (num_kv_heads, batch, num_splits) if tuning.heads_fastest else (batch, num_kv_heads, num_splits)
    _decode_partition_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * math.log2(math.e) * (kv_scales[0] if fp8 else 1.0), num_splits,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n,
        SPLIT=split,
        HEADS_FASTEST=tuning.heads_fastest, row_order_ptr=row_order, v_scale=float(kv_scales[1]), FP8=fp8,
        window=window or 0, WINDOWED=window is not None, sinks_ptr=sinks, SINKS=sinks is not None,
        num_warps=tuning.num_warps, num_stages=decode_stages(tuning, k_cache.dtype),
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, MAX_SPLITS_PAD=MAX_SPLITS, sinks_ptr=sinks, SINKS=sinks is not None,
            num_warps=tuning.num_warps,
        )
    return out
