"""Sampling without top-k/top-p in one pass over the logits (Triton).

The same draw as ``llmcli.layers.sampler.sample`` with no filters: greedy rows
take the argmax; the others take ``argmax(logits / T + G)`` over the tokens
that min-p keeps, with Gumbel noise ``G`` from the same counter-based hash of
(seed, step, token id). Where the compiled torch version spends its time on
64-bit integer hashing, this kernel hashes in 32-bit arithmetic (the hash only
ever keeps 32 bits) and fuses noise, scaling, masking and the argmax.

Grid ``(rows, vocab chunks)``: each program writes the best (value, token) of
its chunk; a small torch reduction then picks each row's best chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _mix32_u32(x):
    """``llmcli.layers.sampler._mix32`` in uint32 arithmetic (same constant, wrap-around multiply)."""
    c = tl.full((), 0x45D9F3B, tl.uint32)
    x = ((x >> 16) ^ x) * c
    x = ((x >> 16) ^ x) * c
    return (x >> 16) ^ x


@triton.jit
def _gumbel(bits):
    """``llmcli.layers.sampler.gumbel_noise``: ``-log(-log u)``, ``u = (bits + 0.5) / 2**24``, with no log of a
    number near 1 (``tl.log`` is a fast log on the GPU, accurate to an absolute 2**-22 only)."""
    low = bits < 8388608
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    v = ((16777215 - bits).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    s = v / (2.0 - v)
    s2 = s * s
    series = 1.0 + s2 * (0.3333333333333333 + s2 * (0.2 + s2 * (0.14285714285714285 + s2 * (
        0.1111111111111111 + s2 * (0.09090909090909091 + s2 * (0.07692307692307693 + s2 * 0.06666666666666667))))))
    minus_log_u = tl.where(low, -tl.log(u), 2.0 * s * series)
    return -tl.log(minus_log_u)


@triton.jit(do_not_specialize=["vocab"])
def _sample_chunk_kernel(
    logits_ptr, stride_row, row_max_ptr, temps_ptr, min_ps_ptr, row_key_ptr, part_val_ptr, part_idx_ptr,
    vocab, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < vocab
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=valid, other=float("-inf")).to(tl.float32)
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    scaled = logit * inv_t
    floor = tl.load(row_max_ptr + row) * inv_t + tl.log(tl.load(min_ps_ptr + row))
    row_key = tl.load(row_key_ptr + row).to(tl.uint32)
    bits = _mix32_u32(row_key ^ ids.to(tl.uint32)) >> 8  # 24 bits
    noisy = tl.where(scaled < floor, float("-inf"), scaled + _gumbel(bits))
    cand = tl.where(greedy, logit, noisy)
    cand = tl.where(valid, cand, float("-inf"))
    best_val, best_pos = tl.max(cand, axis=0, return_indices=True, return_indices_tie_break_left=True)
    n_chunks = tl.num_programs(1)
    tl.store(part_val_ptr + row * n_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * n_chunks + chunk, chunk * CHUNK + best_pos)


@triton.jit(do_not_specialize=["n"])
def _row_keys_kernel(seeds_ptr, steps_ptr, keys_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    seed = tl.load(seeds_ptr + i, mask=valid, other=0)
    step = tl.load(steps_ptr + i, mask=valid, other=0)
    # the low and high words of the seed, and the step's low word: what ``& 0xFFFFFFFF`` keeps in int64
    lo, hi = seed.to(tl.uint32), (seed >> 32).to(tl.uint32)
    key = _mix32_u32(_mix32_u32(lo ^ _mix32_u32(hi)) ^ step.to(tl.uint32))
    tl.store(keys_ptr + i, key.to(tl.int64), mask=valid)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``llmcli.layers.sampler.row_keys`` as one kernel: [B] int64 keys from [B] int64 seeds and steps."""
    n = seeds.numel()
    keys = torch.empty(n, dtype=torch.int64, device=seeds.device)
    block = 128
    _row_keys_kernel[(triton.cdiv(n, block),)](seeds.contiguous(), steps.contiguous(), keys, n, BLOCK=block)
    return keys


def sample_unfiltered(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor,
                      row_keys: torch.Tensor) -> torch.Tensor:
    """[B] int64 tokens for [B, V] logits (any float dtype, last dimension contiguous); ``row_keys`` are
    ``llmcli.layers.sampler.row_keys(seeds, steps)``."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    row_max = logits.amax(dim=-1).float()
    _sample_chunk_kernel[(rows, chunks)](
        logits, logits.stride(0), row_max, temperatures.float().contiguous(), min_ps.float().contiguous(),
        row_keys.contiguous(), part_val, part_idx, vocab, CHUNK=CHUNK, num_warps=8,
    )
    return part_idx.gather(1, part_val.argmax(dim=-1, keepdim=True)).squeeze(1).long()
