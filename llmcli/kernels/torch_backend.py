"""Reference paged attention in plain PyTorch: runs anywhere, the oracle for the fast backends.

Each sequence gathers only the keys its queries can see (with a sliding window, the window's part of the
cache) and attends through ``torch_attention.causal_attention``, whose memory does not grow with
``q_len x k_len``.

An FP8 cache (``torch.float8_e4m3fn``) holds ``value / scale`` saturated to e4m3's finite range (it has no
infinity: an unclamped cast of a large value gives NaN) and is read back as ``fp8 * scale`` in float32; the
scales are per layer, ``(k_scale, v_scale)``.
"""
from __future__ import annotations

import torch

from llmcli.kernels.backend import AttentionBackend, KVScales
from llmcli.kernels.torch_attention import causal_attention

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as the cache stores it: cast, or for FP8 divided by ``scale`` and saturated first."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache contents as values: FP8 times its scale in float32; other dtypes as they are."""
    return x.float() * scale if x.dtype == FP8_KV_DTYPE else x


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: KVScales = (1.0, 1.0)) -> None:
    """Scatter each token's k/v into its cache slot; slot -1 means 'do not store'."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_new, v_new = quantize_kv(k[keep], k_cache.dtype, kv_scales[0]), quantize_kv(v[keep], v_cache.dtype, kv_scales[1])
    if not k_cache.is_contiguous():  # a layer's view of a shared slab (Gemma 4, engine/kv_cache.py): by block, row
        bs = k_cache.shape[1]
        k_cache[slots // bs, slots % bs] = k_new
        v_cache[slots // bs, slots % bs] = v_new
        return
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k_new
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v_new


def gather_kv_torch(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float = 1.0,
                    start: int = 0) -> torch.Tensor:
    """Tokens ``start .. length - 1`` of one sequence, as [length - start, num_kv_heads, head_dim] (FP8
    dequantized); only the blocks holding them are read."""
    block_size = cache.shape[1]
    first, end = start // block_size, (length + block_size - 1) // block_size
    blocks = cache[block_table[first:end].long()]
    skip = start - first * block_size
    return dequantize_kv(blocks.reshape(-1, *cache.shape[2:])[skip : length - first * block_size], scale)


def window_start(position: int, window: int | None) -> int:
    """The first key position the query at ``position`` sees (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, qk_norm=None, kv_scales: KVScales = (1.0, 1.0),
                window: int | None = None, sinks: torch.Tensor | None = None):
        meta = self.metadata
        assert meta is not None, "prepare() must run before forward()"
        assert qk_norm is None, "this backend does not fuse the q/k transform (fuses_qk_norm_rotary is False)"
        if k_cache is not None and k_cache.numel():
            store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        ks, vs = kv_scales
        out = torch.empty_like(q)
        lens = meta.context_lens.tolist()
        if meta.is_prefill:
            cu_q = meta.cu_seqlens_q.tolist()
            for i, k_len in enumerate(lens):
                lo, hi = cu_q[i], cu_q[i + 1]
                keys, values = k[lo:hi], v[lo:hi]
                prefix = k_len - (hi - lo)
                first = window_start(prefix, window)  # the chunk's first query sees nothing before this
                if meta.has_prefix and prefix > first:
                    # the cached prefix (its part inside the window) from the cache, the chunk's own keys as
                    # computed (as the triton kernel reads them: the same thing unless the cache is FP8)
                    table = meta.block_tables[i]
                    keys = torch.cat([gather_kv_torch(k_cache, table, prefix, ks, first).float(), keys.float()])
                    values = torch.cat([gather_kv_torch(v_cache, table, prefix, vs, first).float(), values.float()])
                out[lo:hi] = causal_attention(q[lo:hi], keys, values, self.scale, window, sinks=sinks)
        else:
            for i, k_len in enumerate(lens):
                if k_len == 0:  # padding row of a graph batch
                    out[i] = 0
                    continue
                first = window_start(k_len - 1, window)
                keys = gather_kv_torch(k_cache, meta.block_tables[i], k_len, ks, first)
                values = gather_kv_torch(v_cache, meta.block_tables[i], k_len, vs, first)
                out[i : i + 1] = causal_attention(q[i : i + 1], keys, values, self.scale, window,
                                                     sinks=sinks)
        return out
