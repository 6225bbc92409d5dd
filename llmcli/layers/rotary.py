"""Rotary position embedding (half-rotation layout) with its scaling rules (default, linear, llama3, yarn), cos/sin
precomputed for every position; and the optional per-head q/k RMSNorm before it (``qk_norm_rotary``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmcli.kernels.backend import rotary_width
from llmcli.layers.compile import compile_on_cuda, triton_on_cuda
from llmcli.layers.norm import rms_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@compile_on_cuda
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor):
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``x / rms(x) * (offset + weight)`` in float32, rounded once to x's dtype (transformers' Qwen3.5, Qwen3-Next
    and Gemma 3 norms, whose weights are stored as ``weight - 1``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)


@triton_on_cuda("qk_norm_rotary")
def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dim: int | None = None, weight_offset: float = 0.0):
    """Per-head RMSNorm of q and k (skipped when the weights are None: Llama, Qwen2, Mistral), then the rotary
    embedding: one kernel on CUDA rather than three (kernels/triton_elementwise.py; a decode step launches hundreds
    of tiny ones), the eager reference here. The triton attention backend runs the same kernel with its KV store
    fused in (layers/attention.py).

    ``rotary_dim``: the rotary turns only the first ``rotary_dim`` dims of each head (partial rotary; the
    ``[max_position, rotary_dim]`` tables; None: their width), the rest pass through. ``weight_offset`` != 0:
    the zero-centred norm ``x / rms(x) * (weight_offset + weight)`` (``_zero_centred_rms_norm``)."""
    if q_weight is not None:
        if weight_offset:
            q = _zero_centred_rms_norm(q, q_weight, eps, weight_offset)
            k = _zero_centred_rms_norm(k, k_weight, eps, weight_offset)
        else:
            q = rms_norm.__wrapped__(q, q_weight, eps)
            k = rms_norm.__wrapped__(k, k_weight, eps)
    rot = rotary_width(q.shape[-1], cos, rotary_dim)
    if rot == q.shape[-1]:
        return apply_rotary.__wrapped__(positions, q, k, cos, sin)
    q_rot, k_rot = apply_rotary.__wrapped__(positions, q[..., :rot], k[..., :rot], cos, sin)
    return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)


class UnsupportedRopeError(ValueError):
    """config.json asks for a rotary scaling llmcli does not implement."""


@dataclass
class RopeSettings:
    """What a config says about its rotary embedding, whichever transformers generation wrote it."""

    theta: float
    kind: str = "default"
    params: dict = field(default_factory=dict)  # the scaling entries (factor, original_max_position_embeddings, ...)

    def max_positions(self, max_position_embeddings: int) -> int:
        """Positions the model is meant to reach: YaRN stretches the original window by its factor."""
        if self.kind == "yarn" and self.params.get("original_max_position_embeddings"):
            return max(max_position_embeddings,
                       int(self.params["original_max_position_embeddings"] * (self.params.get("factor") or 1.0)))
        return max_position_embeddings


def rope_settings(config: Any, layer_type: str | None = None) -> RopeSettings:
    """The rotary settings of ``config``; raises ``UnsupportedRopeError`` naming the field for other scalings.

    transformers 5 writes ``rope_parameters`` (``rope_theta`` and the scaling entries in one dict, no top-level
    ``rope_theta``); transformers 4 wrote top-level ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``).
    Models with a rotary per layer kind (Gemma 3) key ``rope_parameters`` by ``layer_type``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    field_name = "rope_parameters"
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, field_name = dict(params[layer_type]), f"rope_parameters.{layer_type}"
    elif "full_attention" in params and isinstance(params["full_attention"], dict):
        params, field_name = dict(params["full_attention"]), "rope_parameters.full_attention"
    if not params.get("rope_type") and not params.get("type"):
        legacy = getattr(config, "rope_scaling", None)
        if legacy:
            params.update(legacy)
            field_name = "rope_scaling"
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config.json gives no rope_theta (neither top-level nor in rope_parameters)")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(f"config.json {field_name}.rope_type={kind!r} is not supported; llmcli supports "
                                   f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind in ("linear", "llama3") and params.get("factor") is None:
        raise UnsupportedRopeError(f"config.json {field_name} of type {kind!r} gives no factor")
    return RopeSettings(float(theta), kind, params)


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many leading dims of each head the rotary turns: ``partial_rotary_factor`` (Qwen3.5/Next: 0.25) of
    head_dim, from rope_parameters or the top level; the rest pass through."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, p: dict, max_position_embeddings: int):
    """YaRN's blend of interpolated and extrapolated frequencies and its attention factor, as transformers computes
    them (modeling_rope_utils._compute_yarn_parameters)."""
    original = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``, short ones kept, the band
    between blended smoothly (as transformers' _compute_llama3_parameters)."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, rope: RopeSettings, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor on cos and sin) for ``rope``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.params["factor"], 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope.params), 1.0
    if rope.kind == "yarn":
        return _yarn(inv_freq, head_dim, rope.theta, rope.params, max_position_embeddings)
    if rope.kind == "proportional":  # Gemma 4: the first partial_rotary_factor of the angles turn, the rest stay
        turning = int((rope.params.get("partial_rotary_factor") or 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / (rope.params.get("factor") or 1.0), 1.0
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """The cos/sin tables (buffers, so they follow the model's device) for positions ``0 .. max_position - 1``;
    ``apply_rotary`` uses them. YaRN's attention factor is folded into both tables, as transformers does."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope: RopeSettings | None = None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        rope = rope or RopeSettings(base)
        inv_freq, scale = rope_frequencies(head_dim, rope, max_position_embeddings or max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
