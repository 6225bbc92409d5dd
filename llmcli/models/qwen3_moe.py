"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 whose MLPs are mixtures of experts.

A layer is sparse unless ``mlp_only_layers`` lists it or ``decoder_sparse_step`` skips it (layer ``i`` is sparse
when ``(i + 1) % decoder_sparse_step == 0``), as transformers decides. Dense layers keep the SwiGLU MLP of
``intermediate_size``; sparse ones route each token to ``num_experts_per_tok`` of ``num_experts`` experts of
``moe_intermediate_size`` (``layers/moe.py``).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.moe import SparseMoeBlock
from llmcli.models.decoder import DecoderModel, DecoderSpec
from llmcli.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        self.hf_config = config  # make_model reads the MoE fields, which DecoderSpec does not carry
        super().__init__(config, backend, max_model_len)

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        config = self.hf_config

        def make_mlp(layer_index: int) -> nn.Module | None:  # None: the dense MLP
            if not is_sparse_layer(config, layer_index):
                return None
            return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                  config.num_experts_per_tok, bool(config.norm_topk_prob))

        return DecoderModel(spec, backend, max_positions, make_mlp)
