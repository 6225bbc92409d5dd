"""The ``flash-attn`` attention backend: the flash_attn package's varlen and paged-KV kernels.

Used when ``flash_attn`` is importable (``pip install 'llmcli[flash]'``); its
paged kernels want a KV block size that is a multiple of 256 (``block_size_problem``, which Config asks).
New K/V go into the cache with llmcli's own Triton store kernel. A sliding window goes to flash-attn as
``window_size=(window - 1, 0)``: its query ``i`` sees keys ``i + seqlen_k - seqlen_q - left .. + right``
inclusive, so ``left = window - 1`` gives transformers' window of ``window`` keys ending at the query.
flash_attn 2's kernels have no attention sinks (gpt-oss): a layer with sinks is refused.
"""
from __future__ import annotations

from llmcli.kernels.backend import AttentionBackend


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"
    default_block_size = 256  # its paged kernels take multiples of 256 only

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        return "the flash-attn backend needs a multiple of 256" if block_size % 256 else None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:
            raise ImportError("attention_backend='flash-attn' needs the flash_attn package: "
                              "pip install 'llmcli[flash]', or use attention_backend='triton'") from exc
        from llmcli.kernels.triton_store import store_kv

        self._varlen, self._with_kvcache, self._store = flash_attn_varlen_func, flash_attn_with_kvcache, store_kv

    def forward(self, q, k, v, k_cache, v_cache, qk_norm=None, window: int | None = None, sinks=None):
        if sinks is not None:
            raise NotImplementedError("flash-attn has no attention sinks (gpt-oss's learned per-head logits): "
                                      "use attention_backend='triton' or 'torch'")
        meta = self.metadata
        assert meta is not None, "prepare() must run before forward()"
        assert qk_norm is None, "this backend does not fuse the q/k transform (fuses_qk_norm_rotary is False)"
        # only a window is passed on: a call without one is the call it always was
        local = {} if window is None else {"window_size": (window - 1, 0)}
        if k_cache is not None and k_cache.numel():
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.is_prefill:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                     block_table=meta.block_tables, softmax_scale=self.scale, causal=True, **local)
            return out.squeeze(1)
        if meta.has_prefix:  # keys of every chunk (prefix and itself) come from the paged cache
            return self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                meta.max_seqlen_k, softmax_scale=self.scale, causal=True,
                                block_table=meta.block_tables, **local)
        return self._varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
                            softmax_scale=self.scale, causal=True, **local)
