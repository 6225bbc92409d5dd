"""The linear-attention layers' per-sequence state (conv state and recurrent state) in slots of one pool.

A sequence's slot is its block-table row (``Sequence.table_row``: given at admission, taken back at finish or
preemption), so the runner's ``AttentionMetadata.rows`` says where each batch entry's state lives. A chunk
with no computed prefix starts from a zero state (layers/gated_delta_net.py), which is what makes a preempted
sequence recompute from scratch. After the sequences' slots come the prefix cache's state snapshots
(``engine/state_snapshots.py``: snapshot ``i`` is slot ``slots + i``), so one gather index serves "start
from my row" and "start from a snapshot". The last slot is scratch for the padding rows of a CUDA-graph batch
(row -1).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.layers.gated_delta_net import GatedDeltaNet


def has_linear_layers(hf_config: Any) -> bool:
    """Whether config.json's ``layer_types`` has linear-attention layers (whose state a prefix hit would skip)."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


def num_snapshot_slots(config: Any) -> int:
    """State-snapshot slots (engine/state_snapshots.py) for ``config``: none for a model without linear-attention
    layers or with prefix caching off; ``num_state_snapshots`` when set; else max_num_seqs / 16, from 4 to 32."""
    if not config.enable_prefix_caching or not has_linear_layers(config.hf_config):
        return 0
    if config.num_state_snapshots is not None:
        return config.num_state_snapshots
    return max(4, min(32, config.max_num_seqs // 16))


def linear_layers(model: nn.Module) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one sequence's states take over every linear layer (conv state in ``dtype``, recurrent state in the
    layer's state dtype, float32 unless config.json says otherwise)."""
    total = 0
    for layer in linear_layers(model):
        conv, ssm = layer.state_shapes()
        total += _numel(conv) * dtype.itemsize + _numel(ssm) * (layer.spec.state_dtype or torch.float32).itemsize
    return total


def allocate_state_pool(model: nn.Module, slots: int, dtype: torch.dtype, device: torch.device,
                        snapshots: int = 0) -> list[torch.Tensor]:
    """Zeroed states for ``slots`` rows, ``snapshots`` snapshot slots and the scratch slot, attached to each
    linear layer; the tensors."""
    held = []
    rows = slots + snapshots + 1
    for layer in linear_layers(model):
        conv, ssm = layer.state_shapes()
        layer.conv_state = torch.zeros(rows, *conv, dtype=dtype, device=device)
        layer.ssm_state = torch.zeros(rows, *ssm, dtype=layer.spec.state_dtype or torch.float32, device=device)
        held += [layer.conv_state, layer.ssm_state]
    return held


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
