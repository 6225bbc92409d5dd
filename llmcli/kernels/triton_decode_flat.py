"""Paged decode attention over a flat list of KV tiles (stream-K): every program streams the same number of tiles.

The split-KV kernel (``triton_decode``) gives each (row, KV head, split) its own program. A program's fixed
cost (its launch, the chain of loads before its first K tile arrives, its pipeline's fill and drain) is paid
once per program, and with equal contexts all programs of a wave pay it at the same moment, so the memory
system idles between waves. That cost is the same for every model while the bytes behind it are not: Qwen2.5-7B
(4 KV heads) spent half its decode-attention time on it (benchmarks/RESULTS.md, calls T1-T2).

Here a step's work is first laid out once, for every layer (``plan``): each (row, KV head) pair is a segment
of ``ceil(context / BLOCK_N)`` tiles, and the segments of all rows are numbered one after another into a tile
map (for each tile: its segment, how many of its keys are valid, whether it is its segment's first or last
tile, and the cache slot of its first key). A fixed number of programs (``FlatPlan.programs``, a few per SM,
independent of the batch, so one launch fits a captured CUDA graph) then each take an equal run of
consecutive tiles, which may start or end inside a segment. One loop streams the run: the software pipeline
keeps loading across segment boundaries (the map is indexed by the loop counter alone, like a block table),
the online softmax restarts at each segment's first tile, and at each segment's end a program writes the
output directly when it saw the whole segment, or else a partial (normalised output plus base-2 log-sum-exp)
into one of its two slots: slot 0 for the segment its run started inside, slot 1 for the one it ended inside.
A small combine kernel then merges each split segment's partials, in program order, and writes zeros for
rows of context 0 (graph padding). Every row's result depends on where the runs' edges fall, so on the whole
batch's lengths; for one batch it is deterministic.

Tiles never cross a cache block (``BLOCK_N`` is capped at the block size), so a tile is one slot and a
contiguous run of keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile (at most the cache block size)
PROGRAMS_PER_SM = 2  # 3 stages of 64-key bf16 K and V tiles take ~96 KiB of shared memory: two programs fit an SM
PLAN_BLOCK = 256  # map entries a plan program writes per store
PREFIX_BLOCK = 1024  # context lengths a plan program sums per load
COMBINE_BLOCK = 16  # partials the combine merges per load
NUM_WARPS = 4
NUM_STAGES = 3
# tile map entry (int32): bits 0-6 valid keys - 1, bit 7 first tile of its segment, bit 8 last, bits 9-30 segment
_VALID_MASK, _FIRST_BIT, _LAST_BIT, _SEG_SHIFT = 127, 7, 8, 9
MAX_SEGMENTS = 1 << (31 - _SEG_SHIFT)


def tile_keys(block_size: int, block_n: int = BLOCK_N) -> int:
    """Keys per tile for a cache of ``block_size``-key blocks: ``block_n``, or the block size if smaller."""
    n = min(block_n, block_size)
    assert n >= 16 and n & (n - 1) == 0 and n <= 128, f"tile of {n} keys: needs a power of two in 16..128"
    return n


@dataclass
class FlatPlan:
    """Device buffers of one step's tile layout, reused by every layer (sized once, for the largest step)."""

    programs: int
    block_n: int
    tile_meta: torch.Tensor  # int32 [capacity]
    tile_slot: torch.Tensor  # int32 [capacity], cache slot of the tile's first key
    row_start: torch.Tensor  # int32 [max_batch], index of each row's first tile
    total: torch.Tensor  # int32 [1], tiles in the step
    part_out: torch.Tensor  # float32 [programs * 2 * group * head_dim]
    part_lse: torch.Tensor  # float32 [programs * 2 * group]

    @property
    def capacity(self) -> int:
        return self.tile_meta.numel()

    @property
    def max_batch(self) -> int:
        return self.row_start.numel()


def tiles_needed(batch: int, num_kv_heads: int, max_context: int, block_n: int) -> int:
    """The most map entries a step of ``batch`` rows of at most ``max_context`` keys can need."""
    return max(1, batch * num_kv_heads * triton.cdiv(max(max_context, 1), block_n))


def make_plan(programs: int, capacity: int, max_batch: int, group: int, head_dim: int, block_n: int,
              device: torch.device) -> FlatPlan:
    i32 = dict(dtype=torch.int32, device=device)
    return FlatPlan(
        programs=programs, block_n=block_n,
        tile_meta=torch.zeros(capacity, **i32), tile_slot=torch.zeros(capacity, **i32),
        row_start=torch.zeros(max(max_batch, 1), **i32), total=torch.zeros(1, **i32),
        part_out=torch.empty(programs * 2 * group * head_dim, dtype=torch.float32, device=device),
        part_lse=torch.empty(programs * 2 * group, dtype=torch.float32, device=device),
    )


@triton.jit(do_not_specialize=["batch", "num_kv_heads", "stride_bt"])
def _plan_kernel(context_lens_ptr, block_tables_ptr, meta_ptr, slot_ptr, row_start_ptr, total_ptr,
                 batch, num_kv_heads, stride_bt,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PREFIX: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program per row: its first tile's index (the tiles of the rows before it), then its map entries."""
    r = tl.program_id(0)
    before = tl.zeros([PREFIX], tl.int32)
    for c in range(0, r, PREFIX):  # the rows before this one, PREFIX lengths a load
        offs = c + tl.arange(0, PREFIX)
        lens = tl.load(context_lens_ptr + offs, mask=offs < r, other=0)
        before += (lens + BLOCK_N - 1) // BLOCK_N
    start = tl.sum(before, 0) * num_kv_heads
    ctx = tl.load(context_lens_ptr + r)
    n = (ctx + BLOCK_N - 1) // BLOCK_N
    tl.store(row_start_ptr + r, start)
    if r == batch - 1:
        tl.store(total_ptr, start + n * num_kv_heads)
    count = n * num_kv_heads
    bt_row = block_tables_ptr + r.to(tl.int64) * stride_bt
    n_safe = tl.maximum(n, 1)
    for e0 in range(0, count, BLOCK_E):
        idx = e0 + tl.arange(0, BLOCK_E)
        mask = idx < count
        h = idx // n_safe
        j = idx - h * n_safe
        key0 = j * BLOCK_N
        blk = tl.load(bt_row + key0 // BLOCK_SIZE, mask=mask, other=0)
        valid = tl.minimum(ctx - key0, BLOCK_N)
        meta = (valid - 1) | ((j == 0).to(tl.int32) << 7) | ((j == n - 1).to(tl.int32) << 8) \
            | ((r * num_kv_heads + h) << 9)
        tl.store(meta_ptr + start + idx, meta, mask=mask)
        tl.store(slot_ptr + start + idx, blk * BLOCK_SIZE + key0 % BLOCK_SIZE, mask=mask)


@triton.jit(do_not_specialize=["num_kv_heads"])
def _flat_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, meta_ptr, slot_ptr, total_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_ob, stride_oh,
    scale_log2, num_kv_heads, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
):
    p = tl.program_id(0)
    total = tl.load(total_ptr)
    chunk = tl.cdiv(total, tl.num_programs(0))
    t0 = p * chunk
    t1 = tl.minimum(t0 + chunk, total)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_N)
    mask_g = g < GROUP
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    whole = tl.full([], 0, tl.int32)  # 1: the piece being streamed began at its segment's first tile
    for t in range(t0, t1):
        meta = tl.load(meta_ptr + t)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        valid = (meta & 127) + 1
        first = (meta >> 7) & 1
        last = (meta >> 8) & 1
        seg = meta >> 9
        b = seg // num_kv_heads
        kvh = seg - b * num_kv_heads
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=mask_g[:, None], other=0.0)
        if not FP8:
            q = q.to(k_cache_ptr.dtype.element_ty)
        mask_n = offs < valid
        rows = slot + offs
        k = tl.load(k_cache_ptr + rows[:, None] * stride_kcs + kvh * stride_kch + d[None, :],
                    mask=mask_n[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] * stride_vcs + kvh * stride_vch + d[None, :],
                    mask=mask_n[:, None], other=0.0)
        if FP8:  # every e4m3 value is exact in 16 bits
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        begin = (first == 1) | (t == t0)
        m_i = tl.where(begin, float("-inf"), m_i)
        l_i = tl.where(begin, 0.0, l_i)
        acc = tl.where(begin, 0.0, acc)
        whole = tl.where(begin, first, whole)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
        # the piece ends here: the whole segment goes straight to the output, a part of one to a slot
        end = (last == 1) | (t == t1 - 1)
        direct = end & (whole == 1) & (last == 1)
        partial = end & (direct == 0)
        # the heads to write (none unless this tile ends a piece), as one compare: a scalar & a vector mask
        # is not a valid mask under the interpreter
        to_out = g < GROUP * direct.to(tl.int32)
        to_part = g < GROUP * partial.to(tl.int32)
        o = acc / l_i[:, None]
        if FP8:
            o = o * v_scale
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=to_out[:, None])
        prow = (p * 2 + whole) * GROUP + g
        tl.store(part_lse_ptr + prow, m_i + tl.log2(l_i), mask=to_part)
        tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :], o, mask=to_part[:, None])


@triton.jit(do_not_specialize=["num_kv_heads"])
def _flat_combine_kernel(context_lens_ptr, row_start_ptr, total_ptr, part_out_ptr, part_lse_ptr,
                         out_ptr, stride_ob, stride_oh, num_kv_heads, programs,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         COMBINE: tl.constexpr):
    """Grid (batch, num_heads): one head of one row. Merges its segment's partials when the segment was split
    between programs, writes zeros when the row has no context, and does nothing otherwise (written already)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    kvh = hq // GROUP
    g = hq - kvh * GROUP
    d = tl.arange(0, HEAD_DIM)
    dst = out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d
    ctx = tl.load(context_lens_ptr + b)
    n = (ctx + BLOCK_N - 1) // BLOCK_N
    chunk = tl.maximum(tl.cdiv(tl.load(total_ptr), programs), 1)
    start = tl.load(row_start_ptr + b) + kvh * n
    first_p = start // chunk
    last_p = (start + n - 1) // chunk
    if n == 0:
        tl.store(dst, tl.zeros([HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty))
    elif first_p < last_p:
        # the first program holds the segment's beginning in its slot 1, every later one a piece in slot 0
        top = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        o = tl.zeros([HEAD_DIM], tl.float32)
        for p0 in range(first_p, last_p + 1, COMBINE):
            ps = p0 + tl.arange(0, COMBINE)
            mask = ps <= last_p
            prow = ((ps * 2 + (ps == first_p).to(tl.int32)) * GROUP + g).to(tl.int64)
            lse = tl.load(part_lse_ptr + prow, mask=mask, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=mask[:, None], other=0.0,
                           cache_modifier=".cg")
            new_top = tl.maximum(top, tl.max(lse, 0))
            w = tl.exp2(lse - new_top)
            rescale = tl.exp2(top - new_top)
            o = o * rescale + tl.sum(part * w[:, None], 0)
            den = den * rescale + tl.sum(w, 0)
            top = new_top
        tl.store(dst, (o / den).to(out_ptr.dtype.element_ty))


def plan(fp: FlatPlan, block_tables: torch.Tensor, context_lens: torch.Tensor, num_kv_heads: int,
         block_size: int) -> None:
    """Lay out one step's tiles in ``fp`` (device work only: safe inside a captured graph)."""
    batch = context_lens.numel()
    if batch == 0:
        return
    assert batch <= fp.max_batch, f"plan for {fp.max_batch} rows, step has {batch}"
    assert batch * num_kv_heads <= MAX_SEGMENTS
    assert tiles_needed(batch, num_kv_heads, block_tables.shape[1] * block_size, fp.block_n) <= fp.capacity, \
        "tile map too small for this step's block tables"
    _plan_kernel[(batch,)](
        context_lens, block_tables, fp.tile_meta, fp.tile_slot, fp.row_start, fp.total,
        batch, num_kv_heads, block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_N=fp.block_n, PREFIX=PREFIX_BLOCK, BLOCK_E=PLAN_BLOCK, num_warps=4,
    )


def flat_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                scale: float, fp: FlatPlan, out: torch.Tensor | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES) -> torch.Tensor:
    """Attention of ``q`` [batch, num_heads, head_dim] over each row's cached context, by the tile map ``plan``
    wrote for these ``context_lens`` (the same block tables and lengths: the map holds their slots)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    # a slot addresses the whole cache as [slots, kv_heads, head_dim]
    assert k_cache.stride(0) == block_size * k_cache.stride(1) and v_cache.stride(0) == block_size * v_cache.stride(1)
    assert fp.block_n <= block_size
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    assert fp.part_lse.numel() >= fp.programs * 2 * group, "plan made for a smaller GQA group"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _flat_decode_kernel[(fp.programs,)](
        q, k_cache, v_cache, fp.tile_meta, fp.tile_slot, fp.total, out, fp.part_out, fp.part_lse,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e) * (kv_scales[0] if fp8 else 1.0), num_kv_heads, float(kv_scales[1]),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_N=fp.block_n,
        FP8=fp8, num_warps=num_warps, num_stages=num_stages if k_cache.element_size() <= 2 else 2,
    )
    _flat_combine_kernel[(batch, num_heads)](
        context_lens, fp.row_start, fp.total, fp.part_out, fp.part_lse, out, out.stride(0), out.stride(1),
        num_kv_heads, fp.programs,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_N=fp.block_n, COMBINE=COMBINE_BLOCK, num_warps=num_warps,
    )
    return out
