"""SiLU(gate) * up over a fused gate/up projection (SwiGLU), GELU(gate, tanh approximation) * up (GeGLU:
Gemma's ``gelu_pytorch_tanh``), and gpt-oss's clamped SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.layers.compile import triton_on_cuda


@triton_on_cuda("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation over gate then up halves: gate clamped above at ``limit``, up to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def gated_activation(name: str) -> nn.Module:
    """The gate-times-up module of config.json's ``hidden_act`` / ``hidden_activation``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json hidden_act={name!r} is not supported; llmcli supports {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
