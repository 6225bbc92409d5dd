"""Applying a token bitmask to logits on the device: disallowed tokens get -inf before any sampling."""
from __future__ import annotations

import sys

import torch

_BITS = {}  # device -> the 8 bit positions of a byte


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V]; ``mask`` [B, ceil(V/32)] int32 on the same device, bit j of word i allowing token
    32*i + j (an all-ones row, -1, is a no-op). Greedy, top-k/top-p, min-p and seeded draws then only ever
    see allowed tokens, because every one of them ranks -inf last.

    The words are read as bytes (little-endian: byte k of word i holds tokens 32*i + 8*k ...), so the
    expanded mask is one byte per token: a few plain kernels, with no compilation to wait for at the first
    constrained step.
    """
    if mask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"mask covers {mask.shape[-1] * 32} tokens, logits have {logits.shape[-1]}")
    assert sys.byteorder == "little"
    bits = _BITS.get(mask.device)
    if bits is None:
        bits = _BITS[mask.device] = torch.arange(8, dtype=torch.uint8, device=mask.device)
    as_bytes = mask.contiguous().view(torch.uint8)  # [B, 4W]
    allowed = ((as_bytes.unsqueeze(-1) >> bits) & 1).view(torch.bool).flatten(1)[:, : logits.shape[-1]]
    return torch.where(allowed, logits, float("-inf"))
