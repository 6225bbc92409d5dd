"""Variable-length causal prefill attention in Triton (flash-attention style online softmax).

Two flavours share one kernel:

* paged (``PAGED=True``): chunk ``i``'s keys are the first ``context_lens[i]``
  tokens of its sequence, read from the paged cache through its block table
  (the chunk's own K/V have just been stored there). Its ``q_len`` queries are
  the last ``q_len`` of those positions. This covers chunked prefill and
  prefix-cache hits.
* plain (``PAGED=False``): keys and values come straight from the packed
  ``k``/``v`` tensors of the step (no cache needed), ``context_len == q_len``.

Grid ``(num_heads, cdiv(max_seqlen_q, BLOCK_M), batch)``: heads vary fastest so
the programs sharing a KV head run together and hit L2; query tiles run from
the last (most work under the causal mask) to the first. Each program first
sweeps the keys every query of its tile sees (no mask), then the diagonal
tiles with the causal mask.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LARGE_TILES_FROM = 2048  # longest chunk of a step from which the prefill kernel uses 128x128 tiles


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2,
    k_base, v_base, bt_row, tok0,
    stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, MASKED: tl.constexpr,
):
    """Fold keys [n0, n0 + BLOCK_N) into the running (max, sum, acc) of one query tile."""
    pos = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if PAGED:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < k_len, other=0).to(tl.int64)
        k_rows = blk * stride_kcb + (pos % BLOCK_SIZE) * stride_kcs
        v_rows = blk * stride_vcb + (pos % BLOCK_SIZE) * stride_vcs
    else:
        k_rows = (tok0 + pos).to(tl.int64) * stride_kt
        v_rows = (tok0 + pos).to(tl.int64) * stride_vt
    if MASKED:
        in_range = pos < k_len
        k = tl.load(k_base + k_rows[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_base + k_rows[:, None] + d[None, :])
        v = tl.load(v_base + v_rows[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k)) * scale_log2  # scaled in fp32: exp2 below, so log2(e) folded in
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < k_len)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows whose every key so far is masked keep m == -inf; shift by 0 to avoid inf - inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per step (see triton_decode)
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    stride_bt, stride_ot, stride_oh, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
):
    h = tl.program_id(0)
    m_blk = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    tok0 = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - tok0
    if m_blk * BLOCK_M >= q_len:
        return
    if PAGED:
        k_len = tl.load(context_lens_ptr + b)
    else:
        k_len = q_len
    first_pos = k_len - q_len  # absolute position of the chunk's first query

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = first_pos + offs_m
    d = tl.arange(0, HEAD_DIM)
    q_rows = (tok0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mask_m[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    kvh = h // GROUP
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys before the tile's first query are visible to all its rows: no mask needed
    full_end = ((first_pos + m_blk * BLOCK_M) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2, k_base, v_base, bt_row, tok0,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, False)
    last_pos = first_pos + tl.minimum((m_blk + 1) * BLOCK_M, q_len)  # one past the tile's last query
    for n0 in range(full_end, last_pos, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2, k_base, v_base, bt_row, tok0,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, True)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _tiles(head_dim: int, elem_size: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper's 227 KiB of shared memory per SM.

    Measured on an H200 (bf16, head_dim 128): 128x128 tiles reach ~355 TFLOP/s on long
    chunks; 64x64 tiles win on short ones (more programs, less padding in the query tile).
    float32 and head_dim 256 get smaller tiles so the pipelined K/V tiles fit.
    """
    if elem_size > 2 or head_dim > 128:
        return 64, 32, 4, 2
    if max_seqlen_q >= LARGE_TILES_FROM:
        return 128, 128, 8, 2
    return 64, 64, 4, 3


def _check(q: torch.Tensor, head_dim: int) -> None:
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, "head_dim must be a power of two >= 16"
    assert q.stride(-1) == 1


def _launch(q: torch.Tensor, out: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
            tensors: tuple, strides: tuple, group: int, block_size: int, paged: bool, scale: float) -> torch.Tensor:
    """Shared set-up of both prefill modes: output, tiles, grid (heads x query tiles x chunks), launch."""
    num_tokens, num_heads, head_dim = q.shape
    _check(q, head_dim)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n, warps, stages = _tiles(head_dim, q.element_size(), max_seqlen_q)
    grid = (num_heads, triton.cdiv(max_seqlen_q, block_m), batch)
    _prefill_kernel[grid](
        q, *tensors, out, q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        scale * math.log2(math.e), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, num_warps=warps, num_stages=stages,
    )
    return out


def prefill_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
    scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each packed chunk over itself; q [T, H, D], k/v [T, KH, D]."""
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    return _launch(q, out, cu_seqlens_q, max_seqlen_q,
                   (k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q),
                   (k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0, 0, 0, 0, 0),
                   q.shape[1] // k.shape[1], 1, False, scale)


def prefill_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk over its cached prefix plus itself, all read from the cache."""
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return _launch(q, out, cu_seqlens_q, max_seqlen_q,
                   (k_cache, v_cache, block_tables, cu_seqlens_q, context_lens),
                   (0, k_cache.stride(2), 0, v_cache.stride(2), k_cache.stride(0), k_cache.stride(1),
                    v_cache.stride(0), v_cache.stride(1), block_tables.stride(0)),
                   q.shape[1] // num_kv_heads, block_size, True, scale)
