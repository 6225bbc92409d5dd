"""The attention oracle of the window tests: a plain masked softmax over a whole sequence, written here and
nowhere in llmcli, and paged cases whose cache blocks outside every query's window are NaN (a kernel that reads
one shows it: a NaN value times a zero weight is still NaN)."""
from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass

import torch

TRITON_MODULES = ("triton_store", "triton_elementwise", "triton_decode", "triton_prefill", "triton_backend")


def interpret_triton_without_cuda() -> bool:
    """Whether CUDA is here; without it, Triton's interpreter switched on and llmcli's Triton modules already
    imported with compiled kernels (decorated before the switch) reloaded. Call before importing them. A second
    call reloads nothing: a reload makes new classes and constants, and a test module that imported the old ones
    would compare them unequal to the new."""
    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: its own library kernels follow it too
    from triton.runtime.jit import JITFunction  # the interpreter's kernels are InterpretedFunction instead

    compiled = False  # once a kernel module needed it, the ones importing from it are reloaded too
    for name in TRITON_MODULES:
        module = sys.modules.get(f"llmcli.kernels.{name}")
        if module is None:
            continue
        compiled = compiled or any(isinstance(v, JITFunction) for v in vars(module).values())
        if compiled:
            importlib.reload(module)
    return False


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D] over k/v [Lk, KH, D] (the queries are the last Lq positions), float32: every score, the mask
    ``key <= query`` (and ``key > query - window``), softmax, weighted sum. ``sinks`` [H]: one more logit per
    head in each softmax (gpt-oss's attention sinks), whose weight is dropped, not spent on a value."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    k = k.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    q_pos = torch.arange(q_len)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = torch.einsum("qhd,khd->hqk", q.float().cpu(), k.cpu()) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = sinks.float().cpu()[:, None, None].expand(num_heads, q_len, 1)
        weights = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.cpu())


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D] the step's queries, chunk after chunk
    k: torch.Tensor  # [T, KH, D] the step's new keys (already in the cache too)
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, KH, D]; blocks wholly before every query's window are NaN
    v_cache: torch.Tensor
    tables: torch.Tensor  # [batch, width] int32, -1 padded
    slots: torch.Tensor  # [T] int64
    cu_q: torch.Tensor  # [batch + 1] int32
    cu_k: torch.Tensor
    lens: torch.Tensor  # [batch] int32 context lengths
    ref: torch.Tensor  # [T, H, D] float32: masked_softmax_attention of each chunk over its whole sequence
    poisoned_blocks: int


def paged_case(prefix_lens: list[int], q_lens: list[int], shape: tuple[int, int, int, int], dtype: torch.dtype,
               device: torch.device, window: int | None, seed: int = 0, with_ref: bool = True,
               sinks: torch.Tensor | None = None) -> PagedCase:
    """Chunk ``i``: ``q_lens[i]`` new tokens after ``prefix_lens[i]`` cached ones, in a pool of randomly
    permuted blocks; the new keys are stored in their slots, then every block that no query of its sequence can
    see (all its positions before the first query's window) is filled with NaN. ``with_ref=False``: no
    reference (``ref`` is empty), for sizes a CPU softmax would take long over. ``sinks``: the reference's
    per-head sink logits."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, block_size = shape
    ctx = [p + n for p, n in zip(prefix_lens, q_lens)]
    per_seq = [-(-c // block_size) for c in ctx]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(ctx), max(per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots, refs, row, poisoned = [], [], 0, 0
    for i, (p, n) in enumerate(zip(prefix_lens, q_lens)):
        for j in range(n):
            pos = p + j
            slot = int(tables[i, pos // block_size]) * block_size + pos % block_size
            slots.append(slot)
            k_cache.view(-1, num_kv_heads, head_dim)[slot] = k[row + j]
            v_cache.view(-1, num_kv_heads, head_dim)[slot] = v[row + j]
        keys = k_cache[tables[i, : per_seq[i]].long()].reshape(-1, num_kv_heads, head_dim)[: ctx[i]]
        values = v_cache[tables[i, : per_seq[i]].long()].reshape(-1, num_kv_heads, head_dim)[: ctx[i]]
        if with_ref:
            refs.append(masked_softmax_attention(q[row : row + n], keys, values, head_dim ** -0.5, window, sinks))
        row += n
    for i, p in enumerate(prefix_lens):  # after the reference has read the clean cache
        first_seen = 0 if window is None else max(0, p - window + 1)
        for b in range(first_seen // block_size):
            k_cache[int(tables[i, b])] = float("nan")
            v_cache[int(tables[i, b])] = float("nan")
            poisoned += 1
    cum = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return PagedCase(q.to(device), k.to(device), v.to(device), k_cache.to(device), v_cache.to(device),
                     tables.to(device), torch.tensor(slots, dtype=torch.int64, device=device), cum(q_lens), cum(ctx),
                     torch.tensor(ctx, dtype=torch.int32, device=device), torch.cat(refs) if refs else torch.empty(0), poisoned)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
