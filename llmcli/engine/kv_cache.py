"""Sizing and allocating the KV block pool from what the warm-up left free."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.engine.outputs import MemoryReport
from llmcli.layers.attention import Attention

GIB = 1 << 30
CPU_DEFAULT_KV_GIB = 4.0


class KVCacheTooSmall(RuntimeError):
    """The memory left after weights and activations holds no KV block at all."""

    def __init__(self, message: str, report: MemoryReport) -> None:
        super().__init__(message)
        self.report = report


def kv_bytes_per_token(hf_config: Any, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * hf_config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def plan_kv_cache(config: Config, device: torch.device, per_token: int, weights_bytes: int,
                  activation_peak: int) -> MemoryReport:
    """Decide the number of blocks: the explicit count, else the memory budget that is left."""
    bs = config.kvcache_block_size
    per_block = per_token * bs
    notes: list[str] = []
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization)
        in_use = total - free
        if config.kv_cache_memory_gib is not None:
            available = int(config.kv_cache_memory_gib * GIB)
        else:
            available = budget - in_use - activation_peak
        other = max(0, in_use - weights_bytes)
    else:
        total = _host_memory()
        wanted = config.max_num_seqs * config.max_model_len * per_token
        available = int(config.kv_cache_memory_gib * GIB) if config.kv_cache_memory_gib else min(
            int(CPU_DEFAULT_KV_GIB * GIB), wanted)
        budget, other = available, 0
    num_blocks = config.num_kvcache_blocks or max(0, available // per_block)
    if config.num_kvcache_blocks:
        notes.append("num_kvcache_blocks was set explicitly; the probe's figure was not used")
    if num_blocks == 0:
        short = per_block - available
        knob = ("gpu_memory_utilization (raise it), max_num_batched_tokens or max_num_seqs (lower them)"
                if device.type == "cuda" else "kv_cache_memory_gib or num_kvcache_blocks")
        notes.append(f"no KV block fits: {short / GIB:.2f} GiB more is needed for a single block of "
                     f"{per_block / 2**20:.1f} MiB; change {knob}")
    cache_tokens = num_blocks * bs
    return MemoryReport(
        device=str(device), device_name=device_name(device), total_bytes=total, budget_bytes=budget,
        weights_bytes=weights_bytes, activation_peak_bytes=activation_peak, cuda_graph_bytes=0,
        other_bytes=other, kv_bytes_per_token=per_token, kv_bytes_per_block=per_block, block_size=bs,
        num_blocks=num_blocks, cache_tokens=cache_tokens, max_model_len=config.max_model_len,
        max_concurrent_full_seqs=cache_tokens / config.max_model_len, dtype=str(config.torch_dtype).removeprefix("torch."),
        kv_cache_dtype=str(config.kv_torch_dtype).removeprefix("torch."), notes=notes,
    )


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; each attention layer gets its views."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    cache = torch.empty(2, len(layers), num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
