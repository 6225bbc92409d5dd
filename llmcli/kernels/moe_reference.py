"""Mixture-of-experts in plain PyTorch: the router's top-k and a loop over experts, the oracle of the fused kernel.

CPU runs use it as the MoE layer's backend; ``kernels/triton_moe.py`` is tested against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the ``top_k`` largest, renormalised to sum to 1 when ``normalize``.

    Returns ``(weights [T, top_k] float32, expert ids [T, top_k] int64)``; float32 weights because transformers
    keeps them so until it casts the product to the hidden dtype, and bf16 weights would lose 3 bits.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_activation(gelu: bool, clamp: tuple[float, float] | None) -> None:
    """The experts' activation switches, which both MoE paths take: the clamp belongs to a SwiGLU."""
    if gelu and clamp is not None:
        raise ValueError("the clamped SwiGLU (clamp=(alpha, limit), gpt-oss) and GeGLU (gelu=True, Gemma 4) are "
                         "two activations: pass one")


def expert_activation(h: torch.Tensor, gelu: bool = False, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """An expert's gated activation over its gate then up halves: SwiGLU ``silu(gate) * up``; with ``gelu`` GeGLU
    (tanh GELU); with ``clamp=(alpha, limit)`` gpt-oss's clamped SwiGLU: gate clamped above at ``limit``, up to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    check_activation(gelu, clamp)
    gate, up = h.chunk(2, dim=-1)
    if clamp is not None:
        alpha, limit = clamp
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  gelu: bool = False, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """``sum_j weight_j * down_e(act(gate_up_e(x)))`` over each token's experts ``e = topk_ids[t, j]``.

    ``w13`` is [E, 2I, H] (each expert's gate rows, then its up rows), ``w2`` [E, H, I]; ``b13`` [E, 2I] and
    ``b2`` [E, H] their biases (gpt-oss); ``act`` is ``expert_activation(gelu, clamp)`` (default SwiGLU). One
    batched matmul per expert that has tokens. Syncs with the device (which experts have tokens), so not for
    CUDA graphs.
    """
    check_activation(gelu, clamp)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picked = order[start:start + count]
        start += count
        tokens = picked // topk_ids.shape[1]
        h = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        y = F.linear(expert_activation(h, gelu, clamp), w2[expert], None if b2 is None else b2[expert])
        weight = topk_weights.flatten()[picked].unsqueeze(1)
        out.index_add_(0, tokens, (y * weight).to(x.dtype))
    return out
