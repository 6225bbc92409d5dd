"""Rotary position embedding (half-rotation layout), cos/sin precomputed for every position; and Qwen3's per-head
q/k RMSNorm followed by it (``qk_norm_rotary``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.layers.compile import compile_on_cuda, triton_on_cuda
from llmcli.layers.norm import rms_norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@compile_on_cuda
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor):
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton_on_cuda("qk_norm_rotary")
def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Per-head RMSNorm of q and k, then the rotary embedding: one kernel on CUDA rather than three
    (kernels/triton_elementwise.py; a decode step launches hundreds of tiny ones), the eager reference here.
    The triton attention backend runs the same kernel with its KV store fused in (layers/attention.py)."""
    q = rms_norm.__wrapped__(q, q_weight, eps)
    k = rms_norm.__wrapped__(k, k_weight, eps)
    return apply_rotary.__wrapped__(positions, q, k, cos, sin)


def rope_settings(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from a config of either transformers generation.

    transformers 5 keeps ``rope_theta`` inside ``rope_parameters`` and has no top-level attribute;
    transformers 4 has ``rope_theta`` and ``rope_scaling``.
    """
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config.json gives no rope_theta (neither top-level nor in rope_parameters)")
    scaling = params if params else getattr(config, "rope_scaling", None)
    return float(theta), scaling


class RotaryEmbedding(nn.Module):
    """The cos/sin tables (buffers, so they follow the model's device); ``apply_rotary`` uses them."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind not in (None, "default"):
            raise NotImplementedError(f"rope_scaling type {kind!r} is not supported yet (only the default rotary)")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
