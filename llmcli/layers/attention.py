"""The attention layer: q/k/v in, attention out, through whichever backend the runner chose.

A model whose q and k still need their per-head RMSNorm and rotary embedding passes them un-normalised with a
``QKNormRotary``: where the elementwise functions run as Triton kernels (CUDA, the default
``LLMCLI_ELEMENTWISE=triton``) and the backend can fuse (``fuses_qk_norm_rotary``: triton), the backend does the
transform and its KV store in one kernel, the very kernel ``qk_norm_rotary`` would launch, so the results are
the same bits; everywhere else this layer runs ``qk_norm_rotary`` first and the backend stores as usual.

With an FP8 KV cache the layer also holds its cache's scales (``kv_scales``: the checkpoint's ``k_scale`` /
``v_scale``, else 1.0) and hands them to the backend with every call; a sliding-window layer (Gemma 3's local
layers, Mistral with ``sliding_window``) holds its window and hands it over as ``window``, and a layer with
attention sinks (gpt-oss) its per-head sink logits as ``sinks``. In a model with several KV groups (full and
sliding-window layers, engine/kv_groups.py) each layer first points the backend at its group's block tables and
slots (``use_group``).
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
                 sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> None:
        """``sliding_window``: this layer's window in keys (the query at position p sees keys p - window + 1 ..
        p, as transformers' sliding-window masks); None: full causal attention. ``sinks``: this layer's
        [num_heads] sink logits (the model's parameter, kept by reference: the loader fills it in place)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.sliding_window = sliding_window
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must hold one logit per head ({num_heads}), got shape {tuple(sinks.shape)}")
        # a plain attribute, not a registered parameter: the model owns the sinks (under its checkpoint name)
        object.__setattr__(self, "sinks", sinks)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: tuple[float, float] = (1.0, 1.0)  # of an FP8 cache; the loader sets a checkpoint's
        # this layer's KV group where the model has several (engine/kv_groups.py sets it): which block tables
        # and slots of the step's metadata it reads; None: the one group
        self.kv_group: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                qk_norm: QKNormRotary | None = None) -> torch.Tensor:
        """``qk_norm``: the transform q and k still need (None: they are final)."""
        # only an FP8 cache has scales to pass: the other backends' (and stand-ins') signatures stay as they are
        fp8 = self.k_cache is not None and self.k_cache.dtype == torch.float8_e4m3fn
        extra = {"kv_scales": self.kv_scales} if fp8 else {}
        if self.sliding_window is not None:  # passed only when set, as the scales: full layers call as before
            extra["window"] = self.sliding_window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        if self.kv_group is not None:
            self.backend.use_group(self.kv_group)
        if qk_norm is not None:
            if self.backend.fuses_qk_norm_rotary and triton_kernels_on(q):
                return self.backend.forward(q, k, v, self.k_cache, self.v_cache, qk_norm=qk_norm, **extra)
            n = qk_norm
            q, k = qk_norm_rotary(q, k, n.positions, n.q_weight, n.k_weight, n.eps, n.cos, n.sin,
                                  rotary_dim=n.rotary_dim, weight_offset=n.weight_offset)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, **extra)
