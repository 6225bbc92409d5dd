"""Sizing and allocating the KV block pool from what the warm-up left free, laid out in KV groups
(engine/kv_groups.py: one block id is one block of each of ``layout.slots`` layer tensors, or where the layers'
KV shapes differ one slab that each group's layers share). A hybrid model's pool is one buffer of pages (a
page: a block's slab) whose rows of pages also hold the sequences' linear-attention states
(engine/state_pages.py)."""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.engine.kv_groups import KVLayout, blocks_held, plan_kv_groups, plan_mixed_kv_groups
from llmcli.engine.outputs import MemoryReport
from llmcli.engine.state_pages import StatePages
from llmcli.engine.state_pool import attach_states, fixed_rows, linear_layers
from llmcli.layers.attention import Attention

GIB = 1 << 30
CPU_DEFAULT_KV_GIB = 4.0


class KVCacheTooSmall(RuntimeError):
    """The memory left after weights and activations holds no KV block at all."""

    def __init__(self, message: str, report: MemoryReport) -> None:
        super().__init__(message)
        self.report = report


class KVCacheAllocationError(RuntimeError):
    """The planned KV pool could not be allocated (the device or host has less memory than asked for)."""


def kv_layout(model: nn.Module, max_model_len: int | None = None) -> KVLayout:
    """The model's KV groups, from its attention layers' windows; where the layers differ in KV heads or head size
    (Gemma 4's global layers) or its pages hold linear-attention states too, planned by each layer's size
    (kv_groups.plan_mixed_kv_groups: one slab per block id)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    windows = [m.sliding_window for m in layers]
    if not _uniform(layers) or linear_layers(model):
        return plan_mixed_kv_groups(windows, _sizes(layers), max_model_len)
    return plan_kv_groups(windows, max_model_len)


def _uniform(layers: list[Attention]) -> bool:
    return len({(m.num_kv_heads, m.head_dim) for m in layers}) <= 1


def _sizes(layers: list[Attention]) -> list[int]:
    """Each layer's K and V elements per token."""
    return [2 * m.num_kv_heads * m.head_dim for m in layers]


def kv_bytes_per_token(hf_config: Any, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       model: nn.Module | None = None, layout: KVLayout | None = None) -> int:
    """Bytes one token of one block id takes: a mixed-shape layout's slab, else over the layout's layer
    tensors, else the attention layers of ``model`` (each its own size where they differ), else config.json's
    ``layer_types`` (a hybrid's linear layers keep no KV)."""
    if layout is not None and layout.slab:
        return layout.slab * dtype.itemsize
    attention = [m for m in model.modules() if isinstance(m, Attention)] if model is not None else []
    if not _uniform(attention):
        return sum(_sizes(attention)) * dtype.itemsize
    if layout is not None:
        layers = layout.slots
    elif model is not None:
        layers = len(attention)
    else:
        kinds = getattr(hf_config, "layer_types", None) or ()
        layers = hf_config.num_hidden_layers - sum(kind == "linear_attention" for kind in kinds)
    return 2 * layers * num_kv_heads * head_dim * dtype.itemsize


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def plan_kv_cache(config: Config, device: torch.device, per_token: int, weights_bytes: int,
                  activation_peak: int, row_pages: int = 0, layout: KVLayout | None = None) -> MemoryReport:
    """Decide the number of blocks: the explicit count, else the memory budget that is left. A hybrid model's
    (``row_pages``: the blocks a sequence's linear-attention states take) are pages its states share
    (``describe_states`` adds how): with an explicit count, that many KV blocks beside every state row."""
    all_rows = (config.max_num_seqs + 1 + fixed_rows(config)) * row_pages
    bs = config.kvcache_block_size
    per_block = per_token * bs
    notes: list[str] = []
    if device.type == "cuda":
        budget, in_use, total = _cuda_budget(config, device)
        if config.kv_cache_memory_gib is not None:
            available = int(config.kv_cache_memory_gib * GIB)
        else:
            available = budget - in_use - activation_peak
        other = max(0, in_use - weights_bytes)
        if config.num_kvcache_blocks and all_rows:  # the rows that memory holds beside the blocks asked for
            all_rows = min(all_rows, max(0, available // per_block - config.num_kvcache_blocks))
    else:
        total = _host_memory()
        wanted = config.max_num_seqs * config.max_model_len * per_token
        if layout is not None and layout.num_groups > 1:  # every group's blocks of each sequence
            wanted = config.max_num_seqs * per_block * sum(
                blocks_held(config.max_model_len, w, bs) for w in layout.windows)
        available = int(config.kv_cache_memory_gib * GIB) if config.kv_cache_memory_gib else min(
            int(CPU_DEFAULT_KV_GIB * GIB), wanted + all_rows * per_block)
        budget, other = available, 0
    num_blocks = config.num_kvcache_blocks + all_rows if config.num_kvcache_blocks else max(0, available // per_block)
    if config.num_kvcache_blocks:
        notes.append("num_kvcache_blocks was set explicitly; the probe's figure was not used")
    if device.type == "cpu" and total and num_blocks * per_block > total:
        # Host memory is overcommitted: the allocation could succeed and the run be killed when it fills.
        knob = "num_kvcache_blocks" if config.num_kvcache_blocks else "kv_cache_memory_gib"
        notes.append(f"a KV pool of {num_blocks} blocks is {num_blocks * per_block / GIB:.2f} GiB, more than this "
                     f"machine's {total / GIB:.2f} GiB of memory; lower {knob}")
        num_blocks = 0
    elif num_blocks == 0:
        short = per_block - available
        knob = ("gpu_memory_utilization (raise it), max_num_batched_tokens or max_num_seqs (lower them)"
                if device.type == "cuda" else "kv_cache_memory_gib or num_kvcache_blocks")
        notes.append(f"no KV block fits: {short / GIB:.2f} GiB more is needed for a single block of "
                     f"{per_block / 2**20:.1f} MiB; change {knob}")
    cache_tokens = num_blocks * bs
    groups, concurrent = group_reports(config, layout, per_block), cache_tokens / config.max_model_len
    if layout is not None and layout.num_groups > 1 or any(g["window"] is not None for g in groups):
        per_seq = sum(g["blocks_per_seq"] for g in groups)
        concurrent = num_blocks / per_seq if per_seq else 0.0
        notes.append(f"KV groups: {len(groups)}, one pool of blocks for all; a sliding-window group's blocks go back to it "
                     "as sequences move past them, so a long sequence holds only its window's")
    return MemoryReport(
        device=str(device), device_name=device_name(device), total_bytes=total, budget_bytes=budget,
        weights_bytes=weights_bytes, activation_peak_bytes=activation_peak, cuda_graph_bytes=0,
        other_bytes=other, kv_bytes_per_token=per_token, kv_bytes_per_block=per_block, block_size=bs,
        num_blocks=num_blocks, cache_tokens=cache_tokens, max_model_len=config.max_model_len,
        max_concurrent_full_seqs=concurrent, dtype=str(config.torch_dtype).removeprefix("torch."),
        kv_cache_dtype=str(config.kv_torch_dtype).removeprefix("torch."), kv_groups=groups, notes=notes,
    )


def describe_states(report: MemoryReport, pages: StatePages, row_bytes: int) -> None:
    """A hybrid model's state rows in ``report`` (the pool's pages, ``report.num_blocks``, being decided)."""
    per_block, snapshots = report.kv_bytes_per_block, pages.fixed_rows - 1  # and the scratch row
    report.state_pages = pages
    report.state_row_bytes = row_bytes
    report.state_pool_bytes = pages.reserved * per_block
    report.num_state_snapshots = snapshots
    report.state_snapshot_bytes = snapshots * pages.row_pages * per_block
    usable = max(0, report.num_blocks - pages.reserved)
    report.cache_tokens = usable * report.block_size
    per_seq = sum(g["blocks_per_seq"] for g in report.kv_groups) + (pages.row_pages if pages.shared else 0)
    report.max_concurrent_full_seqs = usable / per_seq if per_seq else 0.0
    cache = f"{snapshots} prefix-cache state snapshots" if snapshots \
        else "no state snapshots: prefix caching is off for this hybrid model"
    where = ("taken from the KV blocks while it runs (the pool's split between states and KV follows the "
             "workload)" if pages.shared else "beside the num_kvcache_blocks KV blocks")
    report.notes.append(f"linear-attention states: {pages.row_pages} blocks ({row_bytes / 2**20:.1f} MiB) a "
                        f"sequence, {where}; {cache} and a scratch row reserved "
                        f"({report.state_pool_bytes / GIB:.3f} GiB)")


def _cuda_budget(config: Config, device: torch.device) -> tuple[int, int, int]:
    """(the budget gpu_memory_utilization gives, the bytes in use now, the device's total)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * config.gpu_memory_utilization), total - free, total


def group_reports(config: Config, layout: KVLayout | None, per_block: int) -> list[dict[str, Any]]:
    """Per KV group: its kind, window and layers, and the most blocks (and bytes) a decoding sequence of
    max_model_len tokens holds in it at once (its prompt's chunks may briefly hold a chunk's more)."""
    if layout is None:
        return []
    out = []
    for window, layers in zip(layout.windows, layout.layers):
        blocks = blocks_held(config.max_model_len, window, config.kvcache_block_size)  # while it decodes
        out.append({"kind": "full" if window is None else f"sliding {window}", "window": window,
                    "layers": len(layers), "blocks_per_seq": blocks, "bytes_per_seq": blocks * per_block})
    return out


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device, layout: KVLayout | None = None,
                      states: tuple[StatePages, torch.dtype] | None = None) -> torch.Tensor:
    """One tensor [2, layer tensors, blocks, block_size, kv_heads, head_dim]; each attention layer gets the views
    of its tensor (its index in its KV group) and, with several groups, its group. Where layers differ in KV heads
    or head size (Gemma 4), one [blocks, block_size * slab] tensor instead (``_allocate_slabs``). A hybrid
    model's (``states``: its state rows and the conv states' dtype): one [pages, page bytes] byte buffer whose
    pages are KV blocks (slabs) or parts of state rows (state_pool.attach_states)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if states is not None:
        assert layout is not None and layout.slab, "a hybrid model's KV layout is a slab (kv_layout)"
        page = block_size * layout.slab * dtype.itemsize
        with _allocation_error(num_blocks, num_blocks * page, device):
            buffer = torch.empty(num_blocks, page, dtype=torch.uint8, device=device)
        _allocate_slabs(layers, layout, num_blocks, block_size, dtype, device, buffer.view(dtype))
        attach_states(model, buffer, *states)
        return buffer
    if not _uniform(layers):
        if layout is None or not layout.slab:
            layout = plan_mixed_kv_groups([None] * len(layers), _sizes(layers))
        return _allocate_slabs(layers, layout, num_blocks, block_size, dtype, device)
    layout = layout if layout is not None else plan_kv_groups([None] * len(layers))
    size = 2 * layout.slots * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
    with _allocation_error(num_blocks, size, device):
        cache = torch.empty(2, layout.slots, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                            device=device)
    for layer, (group, slot) in zip(layers, layout.group_of()):
        layer.k_cache, layer.v_cache = cache[0, slot], cache[1, slot]
        layer.kv_group = group if layout.num_groups > 1 else None
    return cache


def _allocate_slabs(layers: list[Attention], layout: KVLayout, num_blocks: int, block_size: int,
                    dtype: torch.dtype, device: torch.device, cache: torch.Tensor | None = None) -> torch.Tensor:
    """A block id is one row of ``block_size * slab`` elements, whichever group holds it: a layer's K is its
    [block_size, kv_heads, head_dim] at its offset in the row, its V right after; the kernels step from block to
    block by the row's stride, so every layer keeps its own shape. (``cache``: such rows already allocated.)"""
    bs = block_size
    if cache is None:
        with _allocation_error(num_blocks, num_blocks * bs * layout.slab * dtype.itemsize, device):
            cache = torch.empty(num_blocks, bs * layout.slab, dtype=dtype, device=device)
    for layer, (group, _), at in zip(layers, layout.group_of(), layout.offsets):
        n, shape = layer.num_kv_heads * layer.head_dim, (num_blocks, bs, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = cache[:, bs * at:bs * (at + n)].view(shape)
        layer.v_cache = cache[:, bs * (at + n):bs * (at + 2 * n)].view(shape)
        layer.kv_group = group if layout.num_groups > 1 else None
    return cache


@contextlib.contextmanager
def _allocation_error(num_blocks: int, size: int, device: torch.device):
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KVCacheAllocationError(f"cannot allocate the KV cache ({num_blocks} blocks, {size / GIB:.2f} GiB on "
                                     f"{device}): {why}; lower num_kvcache_blocks or kv_cache_memory_gib") from None


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
