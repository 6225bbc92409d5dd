"""The linear-attention layers' per-sequence state (conv state and recurrent state) in slots of one pool.

A sequence's slot is its block-table row (``Sequence.table_row``: given at admission, taken back at finish or
preemption), so the runner's ``AttentionMetadata.rows`` says where each batch entry's state lives. A chunk
with no computed prefix starts from a zero state (layers/gated_delta_net.py), which is what makes a preempted
sequence recompute from scratch. The last slot is scratch for the padding rows of a CUDA-graph batch (row -1).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.layers.gated_delta_net import GatedDeltaNet


def has_linear_layers(hf_config: Any) -> bool:
    """Whether config.json's ``layer_types`` has linear-attention layers (whose state a prefix hit would skip)."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


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


def allocate_state_pool(model: nn.Module, slots: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zeroed states for ``slots`` rows plus the scratch slot, attached to each linear layer; the tensors."""
    held = []
    for layer in linear_layers(model):
        conv, ssm = layer.state_shapes()
        layer.conv_state = torch.zeros(slots + 1, *conv, dtype=dtype, device=device)
        layer.ssm_state = torch.zeros(slots + 1, *ssm, dtype=layer.spec.state_dtype or torch.float32, device=device)
        held += [layer.conv_state, layer.ssm_state]
    return held


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
