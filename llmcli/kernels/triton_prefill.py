"""Variable-length causal prefill attention in Triton (flash-attention style online softmax).

Two flavours share one kernel:

* paged (``PAGED=True``): chunk ``i``'s keys are the first ``context_lens[i]``
  tokens of its sequence. Its ``q_len`` queries are the last ``q_len`` of
  those positions. The cached prefix before them is read from the paged cache
  through the block table; the chunk's own keys (just stored there too) are
  read from the packed ``k``/``v`` of the step, so the causal part never waits
  on a block-table load. This covers chunked prefill and prefix-cache hits.
* plain (``PAGED=False``): keys and values come straight from the packed
  ``k``/``v`` tensors of the step (no cache needed), ``context_len == q_len``.

One program owns one KV head and ``BLOCK_M // GROUP`` consecutive queries of
one chunk: its ``BLOCK_M`` tile rows are those queries times the ``GROUP``
query heads that share the KV head (row ``r`` = query ``r // GROUP``, head
``r % GROUP``), so each K/V tile is loaded once for the whole group and the
causal diagonal spans fewer keys. Grid ``(num_kv_heads, batch, query tiles)``
with the query tiles run from the last (most keys under the causal mask) to
the first, so every chunk's heaviest programs start first. Each program
sweeps the prefix and then the keys every query of its tile sees without a
mask, and only the diagonal key tiles with the causal mask.

With an FP8 cache the prefix tiles are widened to q's dtype times the layer's scales as they are loaded; the
chunk's own keys come from the step's k/v as always (at full precision).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """Compile-time launch shape of the prefill kernel."""

    block_m: int  # tile rows: queries x the GQA group
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread cap: 128 lets two 8-warp programs share an SM
    # one masked loop over all of a chunk's own keys instead of an unmasked loop and a masked one: the K/V
    # pipeline does not drain and refill at the diagonal (a memory latency per program) at the cost of the
    # mask on every tile
    one_loop: bool = False


# Longest chunk of a step from which the 16-bit, head_dim <= 128 kernel uses LARGE tiles (LONG from
# LONG_TILES_FROM). Each distinct Tiles is two more compiled variants at start-up (plain and paged; see
# warmup.compile_variants), so keep these few.
LARGE_TILES_FROM = 128
# Hopper, measured on an H200 (run 19): 128 rows x 32 keys, 8 warps, 4 K/V stages in flight won on 570- and
# 2048-token prompts; capped at 128 registers (no spills at GQA group 2) and 96 KiB of shared memory, two
# programs share an SM, so one's prologue and epilogue hide behind the other's matmuls
LARGE = Tiles(128, 32, 8, 4, maxnreg=128)
# long chunks amortise a program's start over many key tiles: 128x128/w8/s3 won at 8192 tokens (run 19)
LONG_TILES_FROM = 4096
LONG = Tiles(128, 128, 8, 3)
SMALL = Tiles(64, 64, 4, 3)   # short chunks / mixed steps: more programs, less padding
WIDE = Tiles(64, 32, 4, 2)    # float32: smaller K/V tiles so the pipeline fits
# head_dim 256 (Qwen3.5's full-attention layers, Gemma 3): a 64 x 256 float32 accumulator needs 8 warps to stay in
# registers; compiled for sm_90 by Triton 3.9 it takes 64 KiB of shared memory and ~207 registers a thread, no
# spills (4 warps: 255 and spills; 128 rows or 64-key tiles: spills). Not yet timed on a GPU.
HEAD256 = Tiles(64, 32, 8, 2)
# head_dim 512 (Gemma 4's global layers): 16-key tiles halve the K/V bytes again; compiled for sm_90 by Triton 3.9 it
# takes 96 KiB of shared memory and 255 registers with a 108-byte spill (32-key tiles: 1.4 KiB of spills; 32 rows or
# 16 warps spill more). Not yet timed on a GPU.
HEAD512 = Tiles(64, 16, 8, 2)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, q_pos, k_len, qk_scale, k_base, v_base, stride_k, stride_v,
    bt_row, stride_kb, stride_vb,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, MASKED: tl.constexpr, k_scale=1.0, v_scale=1.0, FP8: tl.constexpr = False,
    WINDOWED: tl.constexpr = False, window=0, k_lo=0,
):
    """Fold keys [n0, n0 + BLOCK_N) into the running (max, sum, acc) of one query tile.

    Key ``j`` is row ``j`` from ``k_base`` (packed, ``stride_k`` apart), or (paged) slot ``j % BLOCK_SIZE``
    of cache block ``bt_row[j // BLOCK_SIZE]`` (``stride_kb`` apart). Row offsets stay int32; only a
    chunk's or a cache block's base is int64. ``MASKED`` applies the causal mask and ``j < k_len``; with
    ``WINDOWED`` also the sliding window (``j > q_pos - window``), and keys before ``k_lo`` (which no row of the
    tile sees: their cache blocks may be gone) are not even loaded.
    """
    offs = tl.arange(0, BLOCK_N)
    pos = n0 + offs
    d = tl.arange(0, HEAD_DIM)
    if PAGED:
        if BLOCK_N <= BLOCK_SIZE:
            # n0 is a multiple of BLOCK_N and both are powers of two: the tile lies in one cache block
            blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
            slot = (n0 % BLOCK_SIZE) + offs
            k_ptrs = k_base + blk * stride_kb + (slot * stride_k)[:, None] + d[None, :]
            v_ptrs = v_base + blk * stride_vb + (slot * stride_v)[:, None] + d[None, :]
        else:
            if WINDOWED:
                blks = tl.load(bt_row + pos // BLOCK_SIZE, mask=(pos < k_len) & (pos >= k_lo), other=0).to(tl.int64)
            else:
                blks = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < k_len, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            k_ptrs = k_base + (blks * stride_kb + slot * stride_k)[:, None] + d[None, :]
            v_ptrs = v_base + (blks * stride_vb + slot * stride_v)[:, None] + d[None, :]
    else:
        k_ptrs = k_base + (pos * stride_k)[:, None] + d[None, :]
        v_ptrs = v_base + (pos * stride_v)[:, None] + d[None, :]
    if MASKED:
        in_range = pos < k_len
        if WINDOWED:
            in_range = in_range & (pos >= k_lo)
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    s = tl.dot(q, tl.trans(k))  # raw scores in fp32; the scale (with log2(e) for exp2) is folded in below
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < k_len)
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # a row whose every key so far is masked keeps m == -inf; shift it by 0 to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # accumulate in place (the tensor core adds onto acc): no second fp32 tile in registers
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per step (see triton_decode)
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ot, stride_oh, qk_scale, k_scale, v_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    QPT: tl.constexpr,  # queries per tile: BLOCK_M // GROUP
    ONE_LOOP: tl.constexpr, FP8: tl.constexpr,
    WINDOWED: tl.constexpr,  # a sliding window of ``window`` keys: tiles wholly before it are skipped
    sinks_ptr=None, SINKS: tl.constexpr = False,  # per-head sink logits in the softmax's denominator
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    m_blk = tl.num_programs(2) - 1 - tl.program_id(2)
    tok0 = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - tok0
    q_first = m_blk * QPT  # the tile's first query, counted in the chunk
    if q_first >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // GROUP  # query index in the chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < QPT * GROUP) & (qi < q_len)
    d = tl.arange(0, HEAD_DIM)
    tok_base = tok0.to(tl.int64)
    row_off = qi * stride_qt + head * stride_qh
    q = tl.load(q_ptr + tok_base * stride_qt + row_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if PAGED:
        # the cached prefix [0, prefix_len), read through the block table: every query of the chunk sees all of
        # it. The chunk's own keys come from k/v below (the same values just stored in the cache), so the
        # dependent block-table loads stay out of the causal part.
        prefix_len = tl.load(context_lens_ptr + b) - q_len
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        kc_base = kc_ptr + kvh * stride_kch
        vc_base = vc_ptr + kvh * stride_vch
        prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
        if WINDOWED:
            # in positions of the sequence (the tile's queries are prefix_len + [q_first, last)): keys before
            # ``lo`` are seen by no row (skipped), keys from ``all_from`` by every row (no mask needed)
            lo = tl.maximum(prefix_len + q_first - window + 1, 0)
            start = (lo // BLOCK_N) * BLOCK_N
            last_q = tl.minimum(q_first + QPT, q_len)  # one past the tile's last query
            all_from = tl.cdiv(tl.maximum(prefix_len + last_q - window, 0), BLOCK_N) * BLOCK_N
            mid = tl.minimum(tl.maximum(start, all_from), prefix_full)
            for n0 in range(start, mid, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, n0, qi + prefix_len, prefix_len, qk_scale, kc_base, vc_base, stride_kcs,
                    stride_vcs, bt_row, stride_kcb, stride_vcb, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True,
                    k_scale, v_scale, FP8, True, window, lo)
            for n0 in range(tl.maximum(mid, start), prefix_full, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, n0, qi, prefix_len, qk_scale, kc_base, vc_base, stride_kcs, stride_vcs,
                    bt_row, stride_kcb, stride_vcb, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, k_scale, v_scale,
                    FP8)
            if (prefix_full < prefix_len) & (lo < prefix_len):  # the last, partial tile, if the window reaches it
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, prefix_full, qi + prefix_len, prefix_len, qk_scale, kc_base, vc_base,
                    stride_kcs, stride_vcs, bt_row, stride_kcb, stride_vcb, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
                    True, k_scale, v_scale, FP8, True, window, lo)
        else:
            for n0 in range(0, prefix_full, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, n0, qi, prefix_len, qk_scale, kc_base, vc_base, stride_kcs, stride_vcs,
                    bt_row, stride_kcb, stride_vcb, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, k_scale, v_scale,
                    FP8)
            if prefix_full < prefix_len:  # the prefix's last, partial key tile: masked to the prefix
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, prefix_full, qi + prefix_len, prefix_len, qk_scale, kc_base, vc_base,
                    stride_kcs, stride_vcs, bt_row, stride_kcb, stride_vcb, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
                    True, k_scale, v_scale, FP8)

    # the chunk's own keys, in chunk coordinates: those before the tile's first query are visible to all its
    # rows (no mask); the diagonal tiles after them get the causal mask (ONE_LOOP: every tile does)
    k_base = k_ptr + tok_base * stride_kt + kvh * stride_kh
    v_base = v_ptr + tok_base * stride_vt + kvh * stride_vh
    if WINDOWED:
        # as for the prefix: skip the tiles before the first query's window, no mask where every row sees the
        # keys (inside the last query's window and before the first query), the mask on the rest
        lo = tl.maximum(q_first - window + 1, 0)
        start = (lo // BLOCK_N) * BLOCK_N
        if ONE_LOOP:
            full_end = start
        else:
            full_end = tl.maximum((q_first // BLOCK_N) * BLOCK_N, start)
        last_q = tl.minimum(q_first + QPT, q_len)
        mid = tl.minimum(tl.maximum(start, tl.cdiv(tl.maximum(last_q - window, 0), BLOCK_N) * BLOCK_N), full_end)
        for n0 in range(start, mid, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, n0, qi, q_len, qk_scale, k_base, v_base, stride_kt, stride_vt,
                k_ptr, 0, 0, HEAD_DIM, 1, BLOCK_N, False, True, 1.0, 1.0, False, True, window, lo)
    else:
        lo = 0
        mid = 0
        if ONE_LOOP:
            full_end = 0
        else:
            full_end = (q_first // BLOCK_N) * BLOCK_N
    for n0 in range(mid, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, qi, q_len, qk_scale, k_base, v_base, stride_kt, stride_vt,
            k_ptr, 0, 0, HEAD_DIM, 1, BLOCK_N, False, False)
    last = tl.minimum(q_first + QPT, q_len)  # one past the tile's last query
    for n0 in range(full_end, last, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, qi, q_len, qk_scale, k_base, v_base, stride_kt, stride_vt,
            k_ptr, 0, 0, HEAD_DIM, 1, BLOCK_N, False, True, 1.0, 1.0, False, WINDOWED, window, lo)

    if SINKS:  # the sink's exp joins the sum; it weighs no value. In exp2 units, as m_i.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        corr = tl.exp2(m_i - m_fin)
        l_i = l_i * corr + tl.exp2(sink - m_fin)
        acc = acc * corr[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = qi * stride_ot + head * stride_oh
    dst = out_ptr + tok_base * stride_ot + out_off[:, None] + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tiles(head_dim: int, elem_size: int, max_seqlen_q: int, group: int) -> Tiles:
    """The launch shape for Hopper's 227 KiB of shared memory per SM (see LONG/LARGE/SMALL/WIDE/HEAD256/HEAD512)."""
    if head_dim > 256:
        tiles = HEAD512
    elif head_dim > 128:
        tiles = HEAD256
    elif elem_size > 2:
        tiles = WIDE
    elif max_seqlen_q >= LONG_TILES_FROM:
        tiles = LONG
    elif max_seqlen_q >= LARGE_TILES_FROM:
        tiles = LARGE
    else:
        tiles = SMALL
    if group > tiles.block_m:  # at least one query per tile
        tiles = Tiles(triton.next_power_of_2(group), tiles.block_n, tiles.num_warps, tiles.num_stages)
    return tiles


def _check(q: torch.Tensor, head_dim: int) -> None:
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, "head_dim must be a power of two >= 16"
    assert q.stride(-1) == 1


def _launch(q: torch.Tensor, out: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
            k: torch.Tensor, v: torch.Tensor, paged: tuple | None, scale: float, tiles: Tiles | None,
            kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Shared set-up of both prefill modes: output, tiles, grid (KV heads x chunks x query tiles), launch.

    ``paged`` is ``(k_cache, v_cache, block_tables, context_lens)`` or None; ``kv_scales`` its FP8 scales;
    ``window`` the sliding window in keys (None: full causal attention); ``sinks`` [num_heads] the heads' sink
    logits (None: none).
    """
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, got {window}")
    num_tokens, num_heads, head_dim = q.shape
    _check(q, head_dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    batch = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or batch == 0:
        return out
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_contiguous(), "sinks: one logit per query head"
    group = num_heads // k.shape[1]
    if paged is None:
        kc, vc, tables, ctx_lens, block_size = k, v, cu_seqlens_q, cu_seqlens_q, 1
        cache_strides = (0, 0, 0, 0, 0, 0, 0)
    else:
        kc, vc, tables, ctx_lens = paged
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1
        block_size = kc.shape[1]
        cache_strides = (kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                         tables.stride(0))
    t = tiles or _tiles(head_dim, q.element_size(), max_seqlen_q, group)
    assert t.block_m >= group, f"BLOCK_M {t.block_m} holds no query of a {group}-head group"
    grid = (num_heads // group, batch, triton.cdiv(max_seqlen_q, t.block_m // group))
    _prefill_kernel[grid](
        q, k, v, kc, vc, tables, cu_seqlens_q, ctx_lens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides,
        out.stride(0), out.stride(1), scale * math.log2(math.e), float(kv_scales[0]), float(kv_scales[1]),
        window or 0, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        PAGED=paged is not None, QPT=t.block_m // group, num_warps=t.num_warps, num_stages=t.num_stages,
        ONE_LOOP=t.one_loop, FP8=kc.dtype == torch.float8_e4m3fn, WINDOWED=window is not None,
        sinks_ptr=sinks, SINKS=sinks is not None,
        **({"maxnreg": t.maxnreg} if t.maxnreg else {}),
    )
    return out


def prefill_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
    scale: float, out: torch.Tensor | None = None, tiles: Tiles | None = None, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each packed chunk over itself; q [T, H, D], k/v [T, KH, D].

    ``tiles`` overrides the launch shape (benchmarks sweep it); by default it follows ``_tiles``. ``window``: each
    query sees only the ``window`` keys ending at its own position. ``sinks`` [H] float32: per-head sink logits.
    """
    return _launch(q, out, cu_seqlens_q, max_seqlen_q, k, v, None, scale, tiles, window=window, sinks=sinks)


def prefill_paged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int,
    scale: float, out: torch.Tensor | None = None, tiles: Tiles | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk over its cached prefix plus itself.

    The prefix (the first ``context_lens[i] - q_len`` positions) is read from the paged cache, the
    chunk's own keys from ``k``/``v`` (the step's new K/V, also just stored in the cache). ``kv_scales``:
    the (k, v) scales of an FP8 cache. ``window``: each query sees only the ``window`` keys ending at its own
    position; key tiles wholly before a query tile's window are skipped (a long context costs only the window)
    and never read, so their cache blocks may already be reused. ``sinks`` [H] float32: per-head sink logits.
    """
    return _launch(q, out, cu_seqlens_q, max_seqlen_q, k, v, (k_cache, v_cache, block_tables, context_lens),
                   scale, tiles, kv_scales, window, sinks)
