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


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts ``e = topk_ids[t, j]``
    (``gelu``: tanh-GELU in place of SiLU, Gemma 4's experts).

    ``w13`` is [E, 2I, H] (each expert's gate rows, then its up rows), ``w2`` [E, H, I]; one batched matmul
    per expert that has tokens. Syncs with the device (which experts have tokens), so not for CUDA graphs.
    """
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
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        gated = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        y = F.linear(gated * up, w2[expert])
        weight = topk_weights.flatten()[picked].unsqueeze(1)
        out.index_add_(0, tokens, (y * weight).to(x.dtype))
    return out
