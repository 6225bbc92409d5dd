"""Applying a token bitmask to logits on the device: disallowed tokens get -inf before any sampling."""
from __future__ import annotations

import torch

from llmcli.layers.compile import compile_on_cuda


@compile_on_cuda
def _masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V]; ``mask`` [B, ceil(V/32)] int32 on the same device, bit j of word i allowing token
    32*i + j (an all-ones row, -1, is a no-op). Greedy, top-k/top-p, min-p and seeded draws then only ever
    see allowed tokens, because every one of them ranks -inf last."""
    if mask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"mask covers {mask.shape[-1] * 32} tokens, logits have {logits.shape[-1]}")
    return _masked(logits, mask)
