"""The attention layer: q/k/v in, attention out, through whichever backend the runner chose.

A model whose q and k still need their per-head RMSNorm and rotary embedding passes them un-normalised with a
``QKNormRotary``: where the elementwise functions run as Triton kernels (CUDA, the default
``LLMCLI_ELEMENTWISE=triton``) and the backend can fuse (``fuses_qk_norm_rotary``: triton), the backend does the
transform and its KV store in one kernel, the very kernel ``qk_norm_rotary`` would launch, so the results are
the same bits; everywhere else this layer runs ``qk_norm_rotary`` first and the backend stores as usual.

With an FP8 KV cache the layer also holds its cache's scales (``kv_scales``: the checkpoint's ``k_scale`` /
``v_scale``, else 1.0) and hands them to the backend with every call.
"""
from __future__ import annotations

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend, QKNormRotary
from llmcli.layers.compile import triton_kernels_on
from llmcli.layers.rotary import qk_norm_rotary


class Attention(nn.Module):
    """Holds this layer's KV-cache views (attached by the model runner) and calls the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.sliding_window = sliding_window  # a query sees the last ``sliding_window`` keys (None: all)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: tuple[float, float] = (1.0, 1.0)  # of an FP8 cache; the loader sets a checkpoint's

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                qk_norm: QKNormRotary | None = None) -> torch.Tensor:
        """``qk_norm``: the transform q and k still need (None: they are final)."""
        # only an FP8 cache has scales to pass: the other backends' (and stand-ins') signatures stay as they are
        fp8 = self.k_cache is not None and self.k_cache.dtype == torch.float8_e4m3fn
        scales = {"kv_scales": self.kv_scales} if fp8 else {}
        if self.sliding_window is not None:
            scales["window"] = self.sliding_window
        if qk_norm is not None:
            if self.backend.fuses_qk_norm_rotary and triton_kernels_on(q):
                return self.backend.forward(q, k, v, self.k_cache, self.v_cache, qk_norm=qk_norm, **scales)
            q, k = qk_norm_rotary(q, k, qk_norm.positions, qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps,
                                  qk_norm.cos, qk_norm.sin)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, **scales)
