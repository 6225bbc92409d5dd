"""Reference paged attention in plain PyTorch: runs anywhere, the oracle for the fast backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmcli.kernels.backend import AttentionBackend


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter each token's k/v into its cache slot; slot -1 means 'do not store'."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = k[keep].to(k_cache.dtype)
    flat_v[slots] = v[keep].to(v_cache.dtype)


def gather_kv_torch(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, as [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] against k/v [Lk, KH, D]; the queries are the last Lq of the Lk positions."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # query j sits at absolute position k_len - q_len + j and sees keys up to it
    rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    mask = torch.arange(k_len, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, qk_norm=None):
        meta = self.metadata
        assert meta is not None, "prepare() must run before forward()"
        assert qk_norm is None, "this backend does not fuse the q/k transform (fuses_qk_norm_rotary is False)"
        if k_cache is not None and k_cache.numel():
            store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        lens = meta.context_lens.tolist()
        if meta.is_prefill:
            cu_q = meta.cu_seqlens_q.tolist()
            for i, k_len in enumerate(lens):
                lo, hi = cu_q[i], cu_q[i + 1]
                if meta.has_prefix and k_len > hi - lo:
                    keys = gather_kv_torch(k_cache, meta.block_tables[i], k_len)
                    values = gather_kv_torch(v_cache, meta.block_tables[i], k_len)
                else:
                    keys, values = k[lo:hi], v[lo:hi]
                out[lo:hi] = causal_attention(q[lo:hi], keys, values, self.scale)
        else:
            for i, k_len in enumerate(lens):
                if k_len == 0:  # padding row of a graph batch
                    out[i] = 0
                    continue
                keys = gather_kv_torch(k_cache, meta.block_tables[i], k_len)
                values = gather_kv_torch(v_cache, meta.block_tables[i], k_len)
                out[i : i + 1] = causal_attention(q[i : i + 1], keys, values, self.scale)
        return out
