"""Variable-length causal prefill attention in Triton (flash-attention style online softmax).

Two flavours share one kernel:

* paged (``PAGED=True``): chunk ``i``'s keys are the first ``context_lens[i]``
  tokens of its sequence, read from the paged cache through its block table
  (the chunk's own K/V have just been stored there). Its ``q_len`` queries are
  the last ``q_len`` of those positions. This covers chunked prefill and
  prefix-cache hits.
* plain (``PAGED=False``): keys and values come straight from the packed
  ``k``/``v`` tensors of the step (no cache needed), ``context_len == q_len``.

One program owns one KV head and ``BLOCK_M // GROUP`` consecutive queries of
one chunk: its ``BLOCK_M`` tile rows are those queries times the ``GROUP``
query heads that share the KV head (row ``r`` = query ``r // GROUP``, head
``r % GROUP``), so each K/V tile is loaded once for the whole group and the
causal diagonal spans fewer keys. Grid ``(num_kv_heads, batch, query tiles)``
with the query tiles run from the last (most keys under the causal mask) to
the first, so every chunk's heaviest programs start first. Each program
sweeps the keys every query of its tile sees without a mask, then the
diagonal key tiles with the causal mask.
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


# Longest chunk of a step from which the 16-bit, head_dim <= 128 kernel uses LARGE tiles. Each distinct
# Tiles is one more compiled variant at start-up (model_runner._compile_variants), so keep this to two.
LARGE_TILES_FROM = 128
LARGE = Tiles(128, 64, 8, 3)  # Hopper: 128 rows x 64 keys, 8 warps, 3 K/V stages in flight
SMALL = Tiles(64, 64, 4, 3)   # short chunks / mixed steps: more programs, less padding
WIDE = Tiles(64, 32, 4, 2)    # float32 or head_dim 256: smaller K/V tiles so the pipeline fits


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, q_pos, k_len, qk_scale,
    k_base, v_base, bt_row,
    stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, MASKED: tl.constexpr,
):
    """Fold keys [n0, n0 + BLOCK_N) into the running (max, sum, acc) of one query tile.

    ``k_base``/``v_base`` already point at the chunk's first token (plain) or at the KV head
    (paged), so per-row offsets stay int32; only a cache block's base is int64.
    """
    offs = tl.arange(0, BLOCK_N)
    pos = n0 + offs
    d = tl.arange(0, HEAD_DIM)
    if PAGED:
        if BLOCK_N <= BLOCK_SIZE:
            # n0 is a multiple of BLOCK_N and both are powers of two: the tile lies in one cache block
            blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
            slot = (n0 % BLOCK_SIZE) + offs
            k_ptrs = k_base + blk * stride_kcb + (slot * stride_kcs)[:, None] + d[None, :]
            v_ptrs = v_base + blk * stride_vcb + (slot * stride_vcs)[:, None] + d[None, :]
        else:
            blks = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < k_len, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            k_ptrs = k_base + (blks * stride_kcb + slot * stride_kcs)[:, None] + d[None, :]
            v_ptrs = v_base + (blks * stride_vcb + slot * stride_vcs)[:, None] + d[None, :]
    else:
        k_ptrs = k_base + (pos * stride_kt)[:, None] + d[None, :]
        v_ptrs = v_base + (pos * stride_vt)[:, None] + d[None, :]
    if MASKED:
        in_range = pos < k_len
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k))  # raw scores in fp32; the scale (with log2(e) for exp2) is folded in below
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < k_len)
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
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per step (see triton_decode)
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    stride_bt, stride_ot, stride_oh, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    QPT: tl.constexpr,  # queries per tile: BLOCK_M // GROUP
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    m_blk = tl.num_programs(2) - 1 - tl.program_id(2)
    tok0 = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - tok0
    q_first = m_blk * QPT  # the tile's first query, counted in the chunk
    if q_first >= q_len:
        return
    if PAGED:
        k_len = tl.load(context_lens_ptr + b)
    else:
        k_len = q_len
    first_pos = k_len - q_len  # absolute position of the chunk's first query

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < QPT * GROUP) & (qi < q_len)
    q_pos = first_pos + qi
    d = tl.arange(0, HEAD_DIM)
    tok_base = tok0.to(tl.int64)
    row_off = qi * stride_qt + head * stride_qh
    q = tl.load(q_ptr + tok_base * stride_qt + row_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    if PAGED:
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
    else:
        k_base = k_ptr + tok_base * stride_kt + kvh * stride_kh
        v_base = v_ptr + tok_base * stride_vt + kvh * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys before the tile's first query are visible to all its rows: no mask needed
    full_end = ((first_pos + q_first) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, qk_scale, k_base, v_base, bt_row,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, False)
    last_pos = first_pos + tl.minimum(q_first + QPT, q_len)  # one past the tile's last query
    for n0 in range(full_end, last_pos, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, qk_scale, k_base, v_base, bt_row,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, True)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = qi * stride_ot + head * stride_oh
    dst = out_ptr + tok_base * stride_ot + out_off[:, None] + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tiles(head_dim: int, elem_size: int, max_seqlen_q: int, group: int) -> Tiles:
    """The launch shape for Hopper's 227 KiB of shared memory per SM (see LARGE/SMALL/WIDE above)."""
    if elem_size > 2 or head_dim > 128:
        tiles = WIDE
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
            tensors: tuple, strides: tuple, group: int, block_size: int, paged: bool, scale: float,
            tiles: Tiles | None) -> torch.Tensor:
    """Shared set-up of both prefill modes: output, tiles, grid (KV heads x chunks x query tiles), launch."""
    num_tokens, num_heads, head_dim = q.shape
    _check(q, head_dim)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    batch = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or batch == 0:
        return out
    t = tiles or _tiles(head_dim, q.element_size(), max_seqlen_q, group)
    assert t.block_m >= group, f"BLOCK_M {t.block_m} holds no query of a {group}-head group"
    grid = (num_heads // group, batch, triton.cdiv(max_seqlen_q, t.block_m // group))
    _prefill_kernel[grid](
        q, *tensors, out, q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        scale * math.log2(math.e), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, PAGED=paged, QPT=t.block_m // group,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def prefill_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
    scale: float, out: torch.Tensor | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:
    """Causal attention of each packed chunk over itself; q [T, H, D], k/v [T, KH, D].

    ``tiles`` overrides the launch shape (benchmarks sweep it); by default it follows ``_tiles``.
    """
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    return _launch(q, out, cu_seqlens_q, max_seqlen_q,
                   (k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q),
                   (k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0, 0, 0, 0, 0),
                   q.shape[1] // k.shape[1], 1, False, scale, tiles)


def prefill_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
    out: torch.Tensor | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk over its cached prefix plus itself, all read from the cache."""
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return _launch(q, out, cu_seqlens_q, max_seqlen_q,
                   (k_cache, v_cache, block_tables, cu_seqlens_q, context_lens),
                   (0, k_cache.stride(2), 0, v_cache.stride(2), k_cache.stride(0), k_cache.stride(1),
                    v_cache.stride(0), v_cache.stride(1), block_tables.stride(0)),
                   q.shape[1] // num_kv_heads, block_size, True, scale, tiles)
