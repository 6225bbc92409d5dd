"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 whose feed-forward blocks are sparse mixtures of experts.

A layer is sparse unless it is listed in ``mlp_only_layers`` or ``decoder_sparse_step`` skips it (layer ``i`` is
sparse when ``(i + 1) % decoder_sparse_step == 0``), as transformers decides; dense layers keep Qwen3's MLP
with ``intermediate_size``, sparse ones have ``num_experts`` experts of ``moe_intermediate_size``, of which each
token uses ``num_experts_per_tok``.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.layers.moe import SparseMoeBlock
from llmcli.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return Qwen3MLP(config)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, bool(config.norm_topk_prob))
