"""Temperature scaling and min-p floors, the one formula every sampler path uses (plain torch, no Triton).

A seeded request must draw the same token whichever path its batch takes, so the float operations are
fixed here once: logits are scaled by the product with ``1 / T`` (never divided), and min-p's floor is
``max(logits) * (1 / T) + log(min_p)``, the same number as the max of the scaled logits plus ``log(min_p)``
(a product with a positive number rounds monotonically).
"""
from __future__ import annotations

import torch


def inverse_temperatures(temperatures: torch.Tensor) -> torch.Tensor:
    """[B] float32 ``1 / T`` (1 for greedy rows, ``T <= 0``)."""
    t = temperatures.float()
    return 1.0 / torch.where(t <= 0, 1.0, t)


def min_p_floors(logits: torch.Tensor, inv_t: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """[B] float32 min-p floor on the scaled logits (-inf where min-p is off)."""
    return logits.amax(dim=-1).float() * inv_t + torch.log(min_ps.float())
