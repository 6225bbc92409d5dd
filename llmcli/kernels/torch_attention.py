"""Causal (optionally sliding-window) attention of one sequence in plain PyTorch, in bounded memory.

The torch backend's math, for CPU runs and as the oracle of the fast backends. Scores are never formed for the
whole ``q_len x k_len`` square: queries go in blocks sized so that one block's scores (all heads) stay within
``SCORE_BUDGET`` elements, each block attends over only the keys it can see (its causal prefix, or its window),
and a block whose keys alone would still overflow the budget (very long contexts) folds them in key chunks with an
online softmax. A 20k-token prompt therefore costs tens of MiB of working memory rather than
``heads x 20k x 20k`` floats. GQA needs no copy of the keys per query head: the query heads that share a KV head
become extra query rows of that head.

Window semantics (transformers' sliding-window masks): the query at position ``p`` sees keys ``p - window + 1 ..
p``. Attention sinks (gpt-oss): one learned logit per head joins every softmax's denominator and weighs no
value; for SDPA it is an extra all-zero key and value whose additive mask is the sink, for the online softmax
the starting (max, sum) = (sink, 1).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Elements of one block's score matrix (heads x query rows x keys); float32, so 16 MiB. Small enough that a
# CPU run's attention never dominates its memory, large enough that the matmuls stay efficient.
SCORE_BUDGET = 1 << 22
MIN_QUERY_ROWS = 16  # a query block never gets smaller than this (below it, the keys are chunked instead)


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [n, H, D] as [KH, G * n, D]: row ``g * n + i`` is query ``i`` of query head ``kvh * G + g``."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)


def _ungrouped(o: torch.Tensor, n: int, num_heads: int) -> torch.Tensor:
    """The inverse of ``_grouped``: [KH, G * n, D] back to [n, H, D]."""
    num_kv_heads, _, head_dim = o.shape
    return o.view(num_kv_heads, num_heads // num_kv_heads, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads,
                                                                                                   head_dim)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key visible to query (causal, and inside the window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _online(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, lo: int, hi: int,
            group: int, window: int | None, scale: float, chunk: int,
            row_sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [lo, hi) folded ``chunk`` at a time into a running (max, sum, output): flash attention's recurrence.
    ``row_sinks`` [KH, rows]: each row's sink logit, the recurrence's starting point."""
    num_kv_heads, rows, head_dim = qg.shape
    if row_sinks is None:
        m = torch.full((num_kv_heads, rows), -math.inf, dtype=torch.float32, device=qg.device)
        s_sum = torch.zeros_like(m)
    else:
        m, s_sum = row_sinks.clone(), torch.ones_like(row_sinks)
    acc = torch.zeros(num_kv_heads, rows, head_dim, dtype=torch.float32, device=qg.device)
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        s = torch.matmul(qg, k[:, c0:c1].transpose(1, 2)) * scale
        vis = _visible(q_pos, torch.arange(c0, c1, device=qg.device), window).repeat(group, 1)
        s.masked_fill_(~vis, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # a row with nothing visible yet: no inf - inf
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        s_sum = s_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, v[:, c0:c1])
        m = m_new
    return acc / s_sum.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def _sdpa_with_sink(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    row_sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over the keys plus one all-zero key and value (score 0) whose additive mask is the row's sink."""
    num_kv_heads, _, head_dim = k.shape
    zero = k.new_zeros(num_kv_heads, 1, head_dim)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=qg.device).masked_fill_(~visible, -math.inf)
    bias = torch.cat([bias.expand(num_kv_heads, -1, -1), row_sinks[..., None]], -1)
    return F.scaled_dot_product_attention(qg, torch.cat([k, zero], 1), torch.cat([v, zero], 1), attn_mask=bias,
                                          scale=scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                     score_budget: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D] against k/v [Lk, KH, D]; the queries are the last Lq of the Lk positions, each sees the keys
    at or before it (and, with ``window``, after its position minus ``window``). ``sinks`` [H]: per-head sink
    logits (None: none). Returns [Lq, H, D] in q's dtype, computed in float32 with at most about
    ``2 * score_budget`` scores alive at once (default ``SCORE_BUDGET``)."""
    score_budget = score_budget or SCORE_BUDGET
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if q_len == 0:
        return out
    offset = k_len - q_len  # query j sits at position offset + j
    if offset == 0 and window is None and sinks is None and num_heads * q_len * k_len <= score_budget:
        # a whole prompt with nothing cached (most CPU prefills): SDPA's own causal kernel, which shares KV heads
        # itself, runs ~4x faster on small heads than the grouped rows under an explicit mask below
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                           v.float().transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=group > 1)
        return o[0].transpose(0, 1).to(q.dtype)
    span = k_len if window is None else min(k_len, window)  # keys one query sees, at most
    rows = max(MIN_QUERY_ROWS, min(score_budget // (num_heads * span), math.isqrt(score_budget // num_heads)))
    rows = min(rows, q_len)
    # float32 [KH, Lk, D], once: each block slices it (a view) instead of copying its keys
    kf = k.float().transpose(0, 1).contiguous()
    vf = v.float().transpose(0, 1).contiguous()
    # [KH, G, 1]: the sink of grouped row g * n + i is that of query head kvh * G + g
    head_sinks = None if sinks is None else sinks.float().to(q.device).view(num_kv_heads, group, 1)
    for a in range(0, q_len, rows):
        b = min(a + rows, q_len)
        lo = 0 if window is None else max(0, offset + a - window + 1)  # the block's first visible key
        hi = offset + b  # one past its last
        q_pos = torch.arange(offset + a, offset + b, device=q.device)
        qg = _grouped(q[a:b].float(), num_kv_heads)
        row_sinks = None if head_sinks is None else head_sinks.expand(-1, -1, b - a).reshape(num_kv_heads, -1)
        if num_heads * (b - a) * (hi - lo) <= score_budget:
            mask = _visible(q_pos, torch.arange(lo, hi, device=q.device), window).repeat(group, 1)
            if row_sinks is None:
                o = F.scaled_dot_product_attention(qg, kf[:, lo:hi], vf[:, lo:hi], attn_mask=mask, scale=scale)
            else:
                o = _sdpa_with_sink(qg, kf[:, lo:hi], vf[:, lo:hi], mask, row_sinks, scale)
        else:
            chunk = max(1, score_budget // (num_heads * (b - a)))
            o = _online(qg, kf, vf, q_pos, lo, hi, group, window, scale, chunk, row_sinks)
        out[a:b] = _ungrouped(o, b - a, num_heads).to(q.dtype)
    return out
