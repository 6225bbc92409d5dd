"""The attention layer: q/k/v in, attention out, through whichever backend the runner chose."""
from __future__ import annotations

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend


class Attention(nn.Module):
    """Holds this layer's KV-cache views (attached by the model runner) and calls the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache)
