"""Each row's top-k / top-p threshold without sorting the vocabulary (Triton).

The kept set, as ``llmcli.layers.sampler.filter_logits`` (the sort-based reference) defines it, over the
temperature-scaled logits ``s``: top-k keeps every token with ``s >=`` the k-th largest value (all tokens
tied with the k-th value are kept, as vLLM does); top-p then keeps, of those, every token whose probability
mass strictly above its value (softmax renormalised over the top-k set) is below ``p`` (so ties at the
boundary are kept together too). Both are thresholds on ``s``: a row's filter is one number, and the draw
keeps ``s >= threshold`` (min-p raises it to ``max + log min_p``).

How: the caller passes ``torch.topk``'s WINDOW largest scaled values per row. They settle top-k when
``k <= WINDOW``, and top-p when its boundary falls inside the window: with the top-k set inside it (Qwen3's
defaults, k=20 and p=0.95) no pass over the row at all, else one pass for the softmax's denominator (a
peaked distribution's nucleus is a few tokens). Otherwise one program per row bisects on the float32 value
in its order-preserving integer form: 33 passes over the row counting tokens (top-k) or summing ``exp``
(top-p) at or above the pivot, which ends on an actual value of the row. Fixed shapes, no host sync: a CUDA graph
can hold it. Masses are float32 sums, so a token whose mass above lies within float32 rounding of ``p``
may fall on either side of the boundary (the reference sums in float64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmcli.kernels.triton_sample import _ACCURATE, _mul

WINDOW = 64  # top-k up to this is read off torch.topk's values; beyond, bisection
CHUNK = 2048
_ITERS = tl.constexpr(33)  # halvings of an integer range of at most 2**32 + 1 keys


@triton.jit
def _key(x):
    """float32 -> int64 in the same order (-0.0 first made +0.0, so equal floats get equal keys)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _value(key):
    """The inverse of ``_key``."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _above(row_ptr, vocab, inv_t, pivot, floor_key, m, MASS: tl.constexpr, CHUNK: tl.constexpr,
           ACCURATE: tl.constexpr):
    """Count (or, with MASS, sum of ``exp(s - m)``) of the row's tokens with key >= pivot and >= floor_key."""
    acc = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, vocab, CHUNK):
        ids = start + tl.arange(0, CHUNK)
        # the scaled logit exactly as the draw computes it (a product rounded on its own)
        s = _mul(tl.load(row_ptr + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32), inv_t, ACCURATE)
        k = _key(s)
        hit = (k >= pivot) & (k >= floor_key) & (ids < vocab)
        if MASS:
            acc += tl.where(hit, tl.exp(s - m), 0.0)
        else:
            acc += hit.to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["vocab"])
def _threshold_kernel(logits_ptr, stride_row, inv_t_ptr, top_k_ptr, top_p_ptr, win_ptr, out_ptr, vocab,
                      WINDOW: tl.constexpr, CHUNK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    inv_t = tl.load(inv_t_ptr + row)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.load(top_p_ptr + row)
    j = tl.arange(0, WINDOW)
    win = tl.load(win_ptr + row * WINDOW + j)  # the row's largest scaled values, descending
    m = tl.max(win, axis=0)
    last = tl.min(win, axis=0)  # the window's smallest value: its ties may go on outside the window
    k_on = (k > 0) & (k < vocab)
    low = _key(tl.full((), float("-inf"), tl.float32))
    tau_k = low
    if k_on:
        if k <= WINDOW:
            tau_k = _key(tl.sum(tl.where(j == k - 1, win, 0.0), axis=0))
        else:  # largest key with at least k tokens at or above it: count(lo) >= k > count(hi)
            lo = low
            hi = _key(last) + 1
            for _ in range(_ITERS):
                if hi - lo > 1:
                    mid = lo + (hi - lo) // 2
                    if _above(row_ptr, vocab, inv_t, mid, low, m, False, CHUNK, ACCURATE) >= k.to(tl.float32):
                        lo = mid
                    else:
                        hi = mid
            tau_k = lo
    tau = tau_k
    if p < 1.0:
        wk = _key(win)
        e = tl.where(wk >= tau_k, tl.exp(win - m), 0.0)
        # the top-k set lies inside the window when its smallest value is above the window's last one (whose
        # ties may go on outside the window); then the window holds its whole mass
        k_in_window = k_on & (k <= WINDOW) & (_value(tau_k) > last)
        if k_in_window:
            total = tl.sum(e, axis=0)
        else:
            total = _above(row_ptr, vocab, inv_t, low, tau_k, m, True, CHUNK, ACCURATE)
        target = p * total
        # window values above the last one (all of them with the top-k set inside) have their whole tie group
        # inside it, hence their exact mass above: [WINDOW, WINDOW] comparisons
        complete = win > tl.where(k_in_window, float("-inf"), last)  # (-inf values add no mass either way)
        above = tl.sum(tl.where(wk[None, :] > wk[:, None], e[None, :], 0.0), axis=1)
        if tl.sum(tl.where(complete, e, 0.0), axis=0) >= target:  # the boundary group is one of them
            tau = tl.min(tl.where(complete & (wk >= tau_k) & (above < target), wk, _key(m)), axis=0)
        else:  # largest key whose mass at or above it reaches p: mass(lo) >= target > mass(hi)
            lo = tau_k
            hi = _key(m) + 1
            for _ in range(_ITERS):
                if hi - lo > 1:
                    mid = lo + (hi - lo) // 2
                    if _above(row_ptr, vocab, inv_t, mid, tau_k, m, True, CHUNK, ACCURATE) >= target:
                        lo = mid
                    else:
                        hi = mid
            tau = lo
    tl.store(out_ptr + row, _value(tau))


def thresholds(logits: torch.Tensor, inv_t: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """[B] float32: each row keeps the tokens whose ``logits * inv_t`` is at least this (-inf: no filter).

    ``inv_t`` [B] float32 (1 / temperature, 1 for greedy rows), ``top_ks`` [B] (<= 0 or >= V: off), ``top_ps``
    [B] (1: off). ``logits`` [B, V], any float dtype, last dimension contiguous.
    """
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    window = min(WINDOW, triton.next_power_of_2(vocab))
    if window > vocab:  # a tiny vocabulary: pad the window with -inf below every value
        win = torch.full((rows, window), float("-inf"), device=logits.device)
        win[:, :vocab] = logits.float().sort(dim=-1, descending=True).values * inv_t[:, None]
    else:
        win = logits.topk(window, dim=-1).values.float() * inv_t[:, None]
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _threshold_kernel[(rows,)](logits, logits.stride(0), inv_t.float().contiguous(), top_ks.contiguous(),
                               top_ps.float().contiguous(), win.contiguous(), out, vocab, WINDOW=window,
                               CHUNK=CHUNK, ACCURATE=_ACCURATE, num_warps=8)
    return out
