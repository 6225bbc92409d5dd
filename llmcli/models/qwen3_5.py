"""Qwen3.5 / Qwen3.6 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``):
hybrid decoders of Gated DeltaNet layers (``layers/gated_delta_net.py``) and gated full-attention layers in
the order config.json's ``layer_types`` gives (three to one in the published ones).

The attention layers: q_proj doubled into q and a per-head sigmoid gate on the output, per-head q/k norms, the
rotary over ``partial_rotary_factor`` (0.25) of each head. Every RMSNorm zero-centred (1 + w). The MoE variants
route each token to top-k experts (renormalised) beside a shared expert behind a sigmoid gate; Qwen3-Next's
``decoder_sparse_step`` / ``mlp_only_layers`` leave some layers dense. Qwen3-Next fuses its linear-attention
projections per key head (``in_proj_qkvz``, ``in_proj_ba``), Qwen3.5 keeps them apart.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.gated_delta_net import GatedDeltaNetSpec
from llmcli.layers.moe import SharedExpertMoeBlock, SparseMoeBlock
from llmcli.layers.rotary import rotary_dim
from llmcli.models.decoder import (DecoderForCausalLM, DecoderMLP, DecoderModel, DecoderSpec, head_dim_of,
                                   layer_types_of)
from llmcli.models.qwen3_moe import is_sparse_layer


def linear_spec(config: Any) -> GatedDeltaNetSpec:
    state = getattr(config, "mamba_ssm_dtype", None)
    return GatedDeltaNetSpec(config.linear_num_key_heads, config.linear_num_value_heads,
                             config.linear_key_head_dim, config.linear_value_head_dim,
                             config.linear_conv_kernel_dim, getattr(torch, state) if isinstance(state, str) else None)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        **DecoderForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"), "in_proj_a": ("in_proj", "a"),
    }

    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(
            config, qk_norm=True, qkv_bias=bias, o_bias=bias, layer_types=layer_types_of(config),
            rotary_dim=rotary_dim(config, head_dim_of(config)), zero_centred_norms=True, attn_output_gate=True,
            hidden_act=config.hidden_act, linear=linear_spec(config))

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        """No sliding window to refuse: the hybrid layers are all full or linear attention."""

    def __init__(self, config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        self.hf_config = config  # make_model reads the MoE fields, which DecoderSpec does not carry
        super().__init__(config, backend, max_model_len)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP sparse, top-k renormalised, with the gated shared expert."""

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        return DecoderModel(spec, backend, max_positions, lambda i: shared_expert_moe(self.hf_config, spec, True))


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        **DecoderForCausalLM.packed_modules_mapping,
        "in_proj_qkvz": ("in_proj", "qkvz"), "in_proj_ba": ("in_proj", "ba"),
    }

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        config = self.hf_config

        def make_mlp(i: int) -> nn.Module | None:
            if not is_sparse_layer(config, i):
                return None
            return shared_expert_moe(config, spec, bool(config.norm_topk_prob))

        return DecoderModel(spec, backend, max_positions, make_mlp)


def shared_expert_moe(config: Any, spec: DecoderSpec, normalize: bool) -> nn.Module:
    sparse = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                            config.num_experts_per_tok, normalize)
    return SharedExpertMoeBlock(sparse, DecoderMLP(spec, config.shared_expert_intermediate_size), config.hidden_size)
