"""Tensor parallelism inside one engine: rank helpers the layers use, the process group, workers and their shared-memory control plane."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x):
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def agree_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (what all ranks must use alike: the KV pool's size, max_num_seqs)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
