"""The linear-attention layers' per-sequence state (conv state and recurrent state) in rows of the KV pool's
buffer.

A sequence's state row is its block-table row (``Sequence.table_row``: given at admission, taken back at
finish or preemption), so the runner's ``AttentionMetadata.rows`` says where each batch entry's state lives.
Row ``r`` takes ``row_pages`` consecutive pages (KV blocks) of the buffer (engine/state_pages.py: which rows
and pages are whose); each layer's conv and recurrent state is one strided view over every row, so a CUDA
graph holds fixed addresses. A chunk with no computed prefix starts from a zero state and reads nothing of its
row (layers/gated_delta_net.py: what the pages held before is never read), which is what makes a preempted
sequence recompute from scratch. After the sequences' rows come the prefix cache's state snapshots
(``engine/state_snapshots.py``: snapshot ``i`` is row ``max_num_seqs + 1 + i``), so one gather index serves
"start from my row" and "start from a snapshot". The last row is scratch for the padding rows of a CUDA-graph
batch (row -1).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.engine.state_pages import StatePages
from llmcli.layers.gated_delta_net import GatedDeltaNet

ALIGN = 256  # bytes: each state tensor of a row starts on it (vectorized loads, any dtype's view)


def has_linear_layers(hf_config: Any) -> bool:
    """Whether config.json's ``layer_types`` has linear-attention layers (whose state a prefix hit would skip)."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


def num_snapshot_slots(config: Any, max_num_seqs: int | None = None) -> int:
    """State-snapshot slots (engine/state_snapshots.py) for ``config`` (at ``max_num_seqs`` sequences if given):
    none for a model without linear-attention layers or with prefix caching off; ``num_state_snapshots`` when
    set; else max_num_seqs / 16, from 4 to 32."""
    if not config.enable_prefix_caching or not has_linear_layers(config.hf_config):
        return 0
    if config.num_state_snapshots is not None:
        return config.num_state_snapshots
    return max(4, min(32, (max_num_seqs or config.max_num_seqs) // 16))


def fixed_rows(config: Any, max_num_seqs: int | None = None) -> int:
    """The snapshot rows and the scratch row (at ``max_num_seqs`` sequences if given)."""
    return num_snapshot_slots(config, max_num_seqs) + 1


def plan_state_pages(config: Any, row_pages: int, num_pages: int, kv_min: int, shared: bool,
                     ) -> tuple[StatePages, str | None]:
    """The state rows in a buffer of ``num_pages`` pages, ``config.max_num_seqs`` lowered (before the scheduler is
    made from it) where every sequence's row, with the fixed rows, would not leave ``kv_min`` pages for KV (shared:
    one sequence of max_model_len; static: num_kvcache_blocks): what was done, in a line for the log and the
    memory report."""
    def fits(n: int) -> bool:
        return (n + 1 + fixed_rows(config, n)) * row_pages + kv_min <= num_pages

    line = None
    if not fits(config.max_num_seqs):
        low, high = 0, config.max_num_seqs  # fits(low) or low == 0; the rows needed grow with n
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        kv = f"one sequence of max_model_len={config.max_model_len}" if shared else \
            f"the {kv_min} num_kvcache_blocks"
        line = (f"max_num_seqs lowered from {config.max_num_seqs} to {low}: a sequence's linear-attention states "
                f"take {row_pages} KV blocks, and every sequence's at once must leave room for {kv}; a larger "
                "gpu_memory_utilization admits more")
        config.max_num_seqs = low
    n = config.max_num_seqs
    return StatePages(row_pages, n + 1, fixed_rows(config, n), shared), line


def linear_layers(model: nn.Module) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def row_offsets(model: nn.Module, dtype: torch.dtype) -> tuple[list[tuple[int, int]], int]:
    """Per linear layer the byte offsets of its conv state (in ``dtype``) and recurrent state (the layer's
    state dtype, float32 unless config.json says otherwise) in a row, and the row's bytes."""
    offsets, at = [], 0
    for layer in linear_layers(model):
        conv, ssm = layer.state_shapes()
        conv_at = at
        at = _aligned(at + _numel(conv) * dtype.itemsize)
        offsets.append((conv_at, at))
        at = _aligned(at + _numel(ssm) * _state_dtype(layer).itemsize)
    return offsets, at


def state_row_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one sequence's states take over every linear layer (0: not a hybrid model)."""
    return row_offsets(model, dtype)[1]


def attach_states(model: nn.Module, buffer: torch.Tensor, pages: StatePages, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each linear layer's conv and recurrent state as views of ``buffer`` ([pages, page bytes], uint8) over
    ``pages.rows`` rows of ``pages.row_pages`` pages; the views. Rows and snapshots read only what was written
    into them, so the buffer needs no zeroing."""
    flat = buffer.view(-1)
    stride = pages.row_pages * buffer.shape[1]  # bytes from one row to the next
    if pages.rows * stride > flat.numel():
        raise ValueError(f"{pages.rows} state rows of {stride} bytes do not fit a buffer of {flat.numel()} bytes")
    offsets, _ = row_offsets(model, dtype)
    held = []
    for layer, (conv_at, ssm_at) in zip(linear_layers(model), offsets):
        (channels, taps), ssm = layer.state_shapes()
        # [rows, C, K-1] viewed over [rows, K-1, C]: a conv kernel's block of channels then reads and writes
        # each tap as one contiguous run, where channel-major storage gives it runs of K-1 values
        conv = _typed(flat, dtype, (pages.rows, taps, channels), stride, conv_at)
        layer.conv_state = conv.transpose(1, 2)
        layer.ssm_state = _typed(flat, _state_dtype(layer), (pages.rows, *ssm), stride, ssm_at)
        held += [layer.conv_state, layer.ssm_state]
    return held


def _typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], row_stride: int, at: int) -> torch.Tensor:
    """A [rows, ...] view of ``dtype`` at byte ``at`` of the first row, rows ``row_stride`` bytes apart, each
    row's part contiguous."""
    size = dtype.itemsize
    assert row_stride % size == 0 and at % size == 0 and flat.numel() % size == 0
    strides, inner = [], 1
    for d in reversed(shape[1:]):
        strides.insert(0, inner)
        inner *= d
    return torch.as_strided(flat.view(dtype), shape, (row_stride // size, *strides), at // size)


def _state_dtype(layer: GatedDeltaNet) -> torch.dtype:
    return layer.spec.state_dtype or torch.float32


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
