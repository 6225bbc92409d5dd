"""Reference paged attention in plain PyTorch: runs anywhere, the oracle for the fast backends.

An FP8 cache (``torch.float8_e4m3fn``) holds ``value / scale`` saturated to e4m3's finite range (it has no
infinity: an unclamped cast of a large value gives NaN) and is read back as ``fp8 * scale`` in float32; the
scales are per layer, ``(k_scale, v_scale)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmcli.kernels.backend import AttentionBackend, KVScales

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
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = quantize_kv(k[keep], k_cache.dtype, kv_scales[0])
    flat_v[slots] = quantize_kv(v[keep], v_cache.dtype, kv_scales[1])


def gather_kv_torch(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float = 1.0,
                    ) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, as [length, num_kv_heads, head_dim] (FP8 dequantized)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return dequantize_kv(blocks.reshape(-1, *cache.shape[2:])[:length], scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """q [Lq, H, D] against k/v [Lk, KH, D]; the queries are the last Lq of the Lk positions. ``window``: a query
    at position p sees keys at positions > p - window only (transformers' sliding window)."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # query j sits at absolute position k_len - q_len + j and sees keys up to it
    rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    keys = torch.arange(k_len, device=q.device)[None, :]
    mask = keys <= rows
    if window is not None:
        mask &= keys > rows - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, qk_norm=None, kv_scales: KVScales = (1.0, 1.0),
                window: int | None = None):
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
                if meta.has_prefix and prefix > 0:
                    # the cached prefix from the cache, the chunk's own keys as computed (as the triton kernel
                    # reads them: the same thing unless the cache is FP8)
                    table = meta.block_tables[i]
                    keys = torch.cat([gather_kv_torch(k_cache, table, prefix, ks).float(), keys.float()])
                    values = torch.cat([gather_kv_torch(v_cache, table, prefix, vs).float(), values.float()])
                out[lo:hi] = causal_attention(q[lo:hi], keys, values, self.scale, window)
        else:
            for i, k_len in enumerate(lens):
                if k_len == 0:  # padding row of a graph batch
                    out[i] = 0
                    continue
                keys = gather_kv_torch(k_cache, meta.block_tables[i], k_len, ks)
                values = gather_kv_torch(v_cache, meta.block_tables[i], k_len, vs)
                out[i : i + 1] = causal_attention(q[i : i + 1], keys, values, self.scale, window)
        return out
