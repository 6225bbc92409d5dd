"""SiLU(gate) * up over a fused gate/up projection (SwiGLU), GELU(gate, tanh approximation) * up (GeGLU:
Gemma's ``gelu_pytorch_tanh``). The experts' activations (gpt-oss's clamped SwiGLU) are
``kernels/moe_reference.expert_activation``'s."""
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


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def gated_activation(name: str) -> nn.Module:
    """The gate-times-up module of config.json's ``hidden_act`` / ``hidden_activation``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json hidden_act={name!r} is not supported; llmcli supports {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
