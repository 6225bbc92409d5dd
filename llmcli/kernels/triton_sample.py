"""The Gumbel-max draw in one pass over the logits (Triton), behind a per-row floor.

The same draw as ``llmcli.layers.sampler.sample``: greedy rows take the argmax; the others take
``argmax(logits * (1/T) + G)`` over the tokens whose scaled logit is at least the row's floor (min-p's
``max + log min_p``, raised to the top-k/top-p threshold of ``llmcli.kernels.triton_sample_filter`` when
the row has one), with Gumbel noise ``G`` from the same counter-based hash of (seed, step, token id).
Every float operation is the torch path's, in the same order, with libdevice's ``log`` (the one torch's
CUDA ``log`` calls) where compiled: a seeded request draws the same token on either path, bit for bit.
The hash runs in 32-bit arithmetic (it only ever keeps 32 bits), fused with noise, masking and argmax.

Grid ``(rows, vocab chunks)``: each program writes the best (value, token) of
its chunk; a small torch reduction then picks each row's best chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from llmcli.kernels.sample_scale import inverse_temperatures, min_p_floors

CHUNK = 4096


@triton.jit
def _mix32_u32(x):
    """``llmcli.layers.sampler._mix32`` in uint32 arithmetic (same constant, wrap-around multiply)."""
    c = tl.full((), 0x45D9F3B, tl.uint32)
    x = ((x >> 16) ^ x) * c
    x = ((x >> 16) ^ x) * c
    return (x >> 16) ^ x


@triton.jit
def _log(x, ACCURATE: tl.constexpr):
    """libdevice's logf (torch's CUDA ``log``) when compiled; the interpreter has no libdevice."""
    if ACCURATE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _mul(a, b, ACCURATE: tl.constexpr):
    """``a * b`` rounded on its own: the compiler may not fuse it into an FMA with an add (torch never does)."""
    if ACCURATE:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _add(a, b, ACCURATE: tl.constexpr):
    """``a + b``, never fused with a product before it."""
    if ACCURATE:
        return libdevice.add_rn(a, b)
    return a + b


@triton.jit
def _gumbel(bits, ACCURATE: tl.constexpr = False):
    """``llmcli.layers.sampler.gumbel_noise``: ``-log(-log u)``, ``u = (bits + 0.5) / 2**24``, with no log of a
    number near 1 (``tl.log`` is a fast log on the GPU, accurate to an absolute 2**-22 only). ACCURATE makes
    it bit-equal to torch's: libdevice's log, IEEE division, every product and sum rounded on its own."""
    low = bits < 8388608
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # exact: no rounding to disagree on
    v = ((16777215 - bits).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    s = tl.div_rn(v, 2.0 - v) if ACCURATE else v / (2.0 - v)
    s2 = _mul(s, s, ACCURATE)
    series = _add(0.07692307692307693, _mul(s2, 0.06666666666666667, ACCURATE), ACCURATE)
    series = _add(0.09090909090909091, _mul(s2, series, ACCURATE), ACCURATE)
    series = _add(0.1111111111111111, _mul(s2, series, ACCURATE), ACCURATE)
    series = _add(0.14285714285714285, _mul(s2, series, ACCURATE), ACCURATE)
    series = _add(0.2, _mul(s2, series, ACCURATE), ACCURATE)
    series = _add(0.3333333333333333, _mul(s2, series, ACCURATE), ACCURATE)
    series = _add(1.0, _mul(s2, series, ACCURATE), ACCURATE)
    minus_log_u = tl.where(low, -_log(u, ACCURATE), _mul(_mul(2.0, s, ACCURATE), series, ACCURATE))
    return -_log(minus_log_u, ACCURATE)


@triton.jit(do_not_specialize=["vocab"])
def _sample_chunk_kernel(
    logits_ptr, stride_row, temps_ptr, inv_t_ptr, floor_ptr, row_key_ptr, part_val_ptr, part_idx_ptr,
    vocab, CHUNK: tl.constexpr, ACCURATE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < vocab
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=valid, other=float("-inf")).to(tl.float32)
    greedy = tl.load(temps_ptr + row) <= 0
    scaled = _mul(logit, tl.load(inv_t_ptr + row), ACCURATE)
    floor = tl.load(floor_ptr + row)
    row_key = tl.load(row_key_ptr + row).to(tl.uint32)
    bits = _mix32_u32(row_key ^ ids.to(tl.uint32)) >> 8  # 24 bits
    noisy = tl.where(scaled < floor, float("-inf"), _add(scaled, _gumbel(bits, ACCURATE), ACCURATE))
    cand = tl.where(greedy, logit, noisy)
    cand = tl.where(valid, cand, float("-inf"))
    best_val, best_pos = tl.max(cand, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best_pos = chunk * CHUNK + best_pos
    # a NaN or +inf logit: the chunk's best is NaN at token -1, which the row's argmax (NaN first) then picks,
    # flagging the row without a kernel or a read of its own (-1: the engine fails that request)
    bad = tl.max(((logit != logit) | (logit == float("inf"))).to(tl.int32), axis=0) > 0
    best_val = tl.where(bad, float("nan"), best_val)
    best_pos = tl.where(bad, -1, best_pos)
    n_chunks = tl.num_programs(1)
    tl.store(part_val_ptr + row * n_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * n_chunks + chunk, best_pos)


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


# compiled kernels take libdevice's log; Triton's interpreter (TRITON_INTERPRET, the CPU tests) has none
_ACCURATE = isinstance(_sample_chunk_kernel, triton.runtime.jit.JITFunction)


def sample_with_floor(logits: torch.Tensor, temperatures: torch.Tensor, inv_t: torch.Tensor, floors: torch.Tensor,
                      row_keys: torch.Tensor) -> torch.Tensor:
    """[B] int64 tokens: the Gumbel-max over the tokens whose ``logits * inv_t >= floors`` (raw argmax for
    rows with ``temperatures <= 0``), -1 for a row holding a NaN or +inf; ``row_keys`` are
    ``llmcli.layers.sampler.row_keys(seeds, steps)``."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(rows, chunks)](
        logits, logits.stride(0), temperatures.float().contiguous(), inv_t.contiguous(), floors.contiguous(),
        row_keys.contiguous(), part_val, part_idx, vocab, CHUNK=CHUNK, ACCURATE=_ACCURATE, num_warps=8,
    )
    return part_idx.gather(1, part_val.argmax(dim=-1, keepdim=True)).squeeze(1).long()


def sample_unfiltered(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor,
                      row_keys: torch.Tensor) -> torch.Tensor:
    """[B] int64 tokens for [B, V] logits (any float dtype, last dimension contiguous), min-p the only filter."""
    inv_t = inverse_temperatures(temperatures)
    return sample_with_floor(logits, temperatures, inv_t, min_p_floors(logits, inv_t, min_ps), row_keys)
