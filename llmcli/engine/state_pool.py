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

from typing import Any, Callable

import torch
from torch import nn

from llmcli.layers.gated_delta_net import GatedDeltaNet


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


# The states' share of the memory the weights and activations leave: a large hybrid model's states (Qwen3.6-27B:
# 147 MiB a sequence) would otherwise take all of it at the default max_num_seqs and leave no KV block.
STATE_SHARE = 0.5


def sequences_that_fit(config: Any, per_slot: int, left: int, share: float = STATE_SHARE) -> int:
    """The most sequences, up to max_num_seqs, whose state slots, with the prefix cache's snapshots and the two
    spare slots the probe counts, take at most ``share`` of ``left`` bytes (0 when not even one does)."""
    def fits(n: int) -> bool:
        return (n + 2 + num_snapshot_slots(config, n)) * per_slot <= left * share

    low, high = 0, config.max_num_seqs  # fits(low) or low == 0; the slots needed grow with n
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def fit_max_num_seqs(config: Any, per_slot: int, left: int, agree: Callable[[int], int] = int) -> str | None:
    """Lower ``config.max_num_seqs`` (before the scheduler and the pool are made from it) where the sequences'
    states would take more than ``STATE_SHARE`` of the ``left`` bytes; ``agree`` makes tensor-parallel ranks
    settle on one figure. What was done, in a line for the log and the memory report, or None."""
    fit = max(1, agree(sequences_that_fit(config, per_slot, left)))
    if fit >= config.max_num_seqs:
        return None
    line = (f"max_num_seqs lowered from {config.max_num_seqs} to {fit}: a sequence's linear-attention states take "
            f"{per_slot / 2**20:.0f} MiB and may use {STATE_SHARE:.0%} of the {left / 2**30:.1f} GiB left after "
            "weights and activations (the rest holds KV blocks); a larger gpu_memory_utilization admits more")
    config.max_num_seqs = fit
    return line


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
        # [rows, C, K-1] viewed over [rows, K-1, C] storage: a conv kernel's block of channels then reads and
        # writes each tap as one contiguous run, where channel-major storage gives it runs of K-1 values
        layer.conv_state = torch.zeros(rows, *conv[::-1], dtype=dtype, device=device).transpose(1, 2)
        layer.ssm_state = torch.zeros(rows, *ssm, dtype=layer.spec.state_dtype or torch.float32, device=device)
        held += [layer.conv_state, layer.ssm_state]
    return held


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
