"""RMSNorm, optionally fused with the residual add that precedes it; its zero-centred form (Gemma, Qwen3.5/Next:
the checkpoint stores ``w`` and the norm multiplies by ``1 + w``) and the gated form of linear-attention layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.layers.compile import triton_on_cuda
from llmcli.layers.weight_shape import expect_shape


@triton_on_cuda("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@triton_on_cuda("add_rms_norm")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual  # in the model dtype, as the reference implementation adds
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class ScaledRMSNorm(RMSNorm):
    """An RMSNorm whose stored gain is the checkpoint's ``w`` times ``gain``, a constant folded in (a query's
    softmax scale, through its per-head norm), so the forward and its CUDA kernels are the plain RMSNorm's."""

    offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, gain: float = 1.0) -> None:
        super().__init__(hidden_size, eps)
        self.gain = gain
        self.weight.weight_loader = self.weight_loader
        self.weight.dummy_value = gain  # load_format='dummy': a unit norm

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Load ``w`` as ``(offset + w) * gain``, computed in float32, then cast."""
        expect_shape(loaded, param.shape)
        param.data.copy_((loaded.float() + self.offset) * self.gain)


class ZeroCentredRMSNorm(ScaledRMSNorm):
    """An RMSNorm whose checkpoint weight ``w`` means a gain of ``1 + w``: the gain is stored (the loader adds the
    one); dummy weights (norms at 1) mean w = 0."""

    offset = 1.0


def rms_norm_no_gain(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim in float32, rounded once (Gemma 4's value norm, which has no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@triton_on_cuda("gated_rms_norm")
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` per head (the output norm of a Gated DeltaNet layer): the norm in
    float32, rounded to x's dtype before the gain, the gate in float32."""
    dtype = x.dtype
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)
