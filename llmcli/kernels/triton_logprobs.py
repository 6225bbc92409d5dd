"""Log probabilities of chosen tokens and the top k, in one read of the logits (Triton).

A token's logprob is ``logit - logsumexp(row)``, and the k likeliest tokens are the
k largest logits, so nothing of size vocab is ever written. Grid ``(rows, vocab
chunks)``: each program reads its chunk once (any float dtype, computed in
float32) and writes its max, its sum of ``exp(x - max)``, how many logits beat the
row's target and its own top ``K``; a second kernel, one program per row, merges
the chunks. The torch version (``llmcli.layers.logprobs``) took a compiled
three-loop reduction, a radix-select top-k with its sort, and a handful of small
kernels per step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit(do_not_specialize=["vocab"])
def _chunk_kernel(logits_ptr, stride_row, targets_ptr, vocab, part_max_ptr, part_sum_ptr, part_count_ptr,
                  part_val_ptr, part_idx_ptr, CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    offs = tl.arange(0, CHUNK)
    ids = chunk * CHUNK + offs
    valid = ids < vocab
    base = logits_ptr + row.to(tl.int64) * stride_row
    x = tl.load(base + ids, mask=valid, other=float("-inf")).to(tl.float32)
    chosen = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)
    count = tl.sum((x > chosen).to(tl.int32), axis=0)
    part = row * n_chunks + chunk
    tl.store(part_max_ptr + part, m)
    tl.store(part_sum_ptr + part, s)
    tl.store(part_count_ptr + part, count)
    for i in tl.static_range(K):  # the chunk's top K, largest first; ties: the lower token id first
        v, p = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(part_val_ptr + part * K + i, v)
        tl.store(part_idx_ptr + part * K + i, chunk * CHUNK + p)
        x = tl.where(offs == p, float("-inf"), x)


@triton.jit(do_not_specialize=["n_chunks", "k"])
def _merge_kernel(logits_ptr, stride_row, targets_ptr, n_chunks, k, part_max_ptr, part_sum_ptr, part_count_ptr,
                  part_val_ptr, part_idx_ptr, out_lp_ptr, out_rank_ptr, out_ids_ptr, out_top_ptr,
                  BLOCK_C: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    in_row = c < n_chunks
    maxes = tl.load(part_max_ptr + row * n_chunks + c, mask=in_row, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row * n_chunks + c, mask=in_row, other=0.0)
    m = tl.max(maxes, axis=0)
    lse = m + tl.log(tl.sum(sums * tl.exp(maxes - m), axis=0))
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tl.load(targets_ptr + row)).to(tl.float32)
    tl.store(out_lp_ptr + row, chosen - lse)
    count = tl.sum(tl.load(part_count_ptr + row * n_chunks + c, mask=in_row, other=0), axis=0)
    tl.store(out_rank_ptr + row, count.to(tl.int64) + 1)
    j = tl.arange(0, BLOCK_C * K)  # candidates chunk-major: among equal values the lower token id wins
    cand_ok = j < n_chunks * K
    vals = tl.load(part_val_ptr + row * n_chunks * K + j, mask=cand_ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * n_chunks * K + j, mask=cand_ok, other=0)
    for i in tl.static_range(K):
        v, p = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        token = tl.sum(tl.where(j == p, idx, 0), axis=0)
        tl.store(out_ids_ptr + row * k + i, token.to(tl.int64), mask=i < k)
        tl.store(out_top_ptr + row * k + i, v - lse, mask=i < k)
        vals = tl.where(j == p, float("-inf"), vals)


def padded_k(k: int) -> int:
    """The top-k width a kernel is built for: a power of two (k up to 20 needs at most 6 builds)."""
    return 1 if k <= 1 else triton.next_power_of_2(k)


def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """(logprobs [R] float32, ranks [R] int64, top ids [R, k] int64, top logprobs [R, k] float32) of
    ``targets`` [R] under ``logits`` [R, V] (last dimension contiguous)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    dev = logits.device
    K = padded_k(k)
    chunks = triton.cdiv(vocab, CHUNK)
    targets = targets.contiguous()
    part_max = torch.empty((rows, chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    part_count = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    part_val = torch.empty((rows, chunks, K), dtype=torch.float32, device=dev)
    part_idx = torch.empty((rows, chunks, K), dtype=torch.int32, device=dev)
    out_lp = torch.empty(rows, dtype=torch.float32, device=dev)
    out_rank = torch.empty(rows, dtype=torch.int64, device=dev)
    out_ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    out_top = torch.empty((rows, k), dtype=torch.float32, device=dev)
    if rows == 0:
        return out_lp, out_rank, out_ids, out_top
    _chunk_kernel[(rows, chunks)](logits, logits.stride(0), targets, vocab, part_max, part_sum, part_count,
                                  part_val, part_idx, CHUNK=CHUNK, K=K, num_warps=8)
    _merge_kernel[(rows,)](logits, logits.stride(0), targets, chunks, k, part_max, part_sum, part_count,
                           part_val, part_idx, out_lp, out_rank, out_ids, out_top,
                           BLOCK_C=triton.next_power_of_2(chunks), K=K, num_warps=4)
    return out_lp, out_rank, out_ids, out_top
