"""Gemma 4 text (``Gemma4ForCausalLM``; ``Gemma4ForConditionalGeneration`` through models/multimodal.py): Gemma 3's
local / global layers, sandwich norms, GeGLU and final-logit softcapping, with

- global layers of their own head size and KV heads (config.json's ``global_head_dim`` and
  ``num_global_key_value_heads``, which transformers keeps as ``per_layer_config``), and K = V there
  (``attention_k_eq_v``: no v_proj, v is the k projection);
- a gain-free RMSNorm on v, plain (w, not 1 + w) norms, softmax scale 1 (folded into q's norm gain);
- proportional rotary on the global layers (``rope_parameters.full_attention``: only the first
  ``partial_rotary_factor`` of each head's angles turn, layers/rotary.py);
- each layer's output times its checkpoint ``layer_scalar``;
- on 26B-A4B (``enable_moe_block``) a routed mixture of GeGLU experts beside each dense MLP, routed from the
  residual stream (not the MLP's normed input) by a gain-free RMSNorm, a learned per-dim scale and a per-expert
  scale on the renormalised top-k weights (``Gemma4MoeMLP``).

The edge models' per-layer input embeddings and cross-layer KV sharing are refused by name."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.kernels.moe_reference import route
from llmcli.layers.moe import StackedExperts
from llmcli.layers.norm import rms_norm_no_gain
from llmcli.layers.rotary import rope_settings
from llmcli.models.decoder import (
    DecoderForCausalLM, DecoderMLP, DecoderModel, DecoderSpec, UnsupportedModelError, layer_types_of, make_norm,
)
from llmcli.parallel import all_reduce, tp_size

# the MoE layer's tensors sit beside the layer's mlp in the checkpoint; here they are the mlp's (Gemma4MoeMLP)
MOE_NAMES = ("router", "experts", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
             "post_feedforward_layernorm_2")


def global_attention_shape(config: Any, kinds: tuple[str, ...]) -> tuple[int | None, int | None]:
    """(head_dim, num_kv_heads) of the full-attention layers where they differ from the config's own."""
    per_layer = getattr(config, "per_layer_config", None)
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    if per_layer is None or not full:
        return getattr(config, "global_head_dim", None), getattr(config, "num_global_key_value_heads", None)
    shapes = {(per_layer[i].head_dim, per_layer[i].num_key_value_heads) for i in full}
    if len(shapes) > 1:
        raise UnsupportedModelError(f"config.json per_layer_config gives the full-attention layers several shapes "
                                    f"{sorted(shapes)}; llmcli runs one")
    return shapes.pop()


class Gemma4Router(nn.Module):
    """Top-k of a softmax over ``proj(rmsnorm(x) * scale / sqrt(hidden))``, renormalised, times each chosen
    expert's ``per_expert_scale``; the same on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden_size ** -0.5
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.scale.dummy_value = self.per_expert_scale.dummy_value = 1.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_norm_no_gain(x, self.eps) * self.scale * self.root
        weights, ids = route(F.linear(h, self.proj.weight), self.top_k, normalize=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4MoeMLP(DecoderMLP):
    """The dense GeGLU MLP and the routed experts side by side, each with its own norms, summed."""

    takes_stream = True  # DecoderLayer passes the residual stream too: the router and the experts read it

    def __init__(self, spec: DecoderSpec, config: Any) -> None:
        super().__init__(spec)
        hidden, inter = spec.hidden_size, config.moe_intermediate_size
        if inter % tp_size():
            raise ValueError(f"moe_intermediate_size ({inter}) is not divisible by tensor_parallel_size "
                             f"({tp_size()})")
        self.router = Gemma4Router(hidden, config.num_experts, config.top_k_experts, spec.rms_norm_eps)
        self.experts = StackedExperts(config.num_experts, hidden, inter // tp_size(), stored_stacked=True, gelu=True)
        self.post_feedforward_layernorm_1 = make_norm(spec, hidden)
        self.pre_feedforward_layernorm_2 = make_norm(spec, hidden)
        self.post_feedforward_layernorm_2 = make_norm(spec, hidden)

    def forward(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(super().forward(x))
        weights, ids = self.router(stream)
        experts = all_reduce(self.experts(self.pre_feedforward_layernorm_2(stream), weights, ids))
        return dense + self.post_feedforward_layernorm_2(experts)


class Gemma4ForCausalLM(DecoderForCausalLM):
    hidden_acts = ("gelu_pytorch_tanh",)  # GeGLU (config_checks reads config.json's hidden_activation against it)
    packed_modules_mapping = {**DecoderForCausalLM.packed_modules_mapping,
                              **{name: (f"mlp.{name}", None) for name in MOE_NAMES}}

    def __init__(self, config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        self.hf_config = config  # make_model reads the MoE fields, which DecoderSpec does not carry
        super().__init__(config, backend, max_model_len)

    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        cls.refuse_edge_features(config)
        kinds = layer_types_of(config)
        head_dim, kv_heads = global_attention_shape(config, kinds)
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(
            config, qk_norm=True, qkv_bias=bias, o_bias=bias, layer_types=kinds,
            sliding_window=config.sliding_window, local_rope=rope_settings(config, "sliding_attention"),
            query_scale=1.0, embed_scale=config.hidden_size ** 0.5, hidden_act=config.hidden_activation,
            sandwich_norms=True, final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            global_head_dim=head_dim, global_num_kv_heads=kv_heads,
            global_k_eq_v=bool(getattr(config, "attention_k_eq_v", False)), v_norm=True, layer_scalar=True)

    @staticmethod
    def refuse_edge_features(config: Any) -> None:
        if getattr(config, "hidden_size_per_layer_input", 0):
            raise UnsupportedModelError(f"config.json hidden_size_per_layer_input="
                                        f"{config.hidden_size_per_layer_input}: llmcli has no per-layer input "
                                        "embeddings (Gemma 4 E2B/E4B); it runs Gemma 4 31B and 26B-A4B")
        if getattr(config, "num_kv_shared_layers", 0):
            raise UnsupportedModelError(f"config.json num_kv_shared_layers={config.num_kv_shared_layers}: llmcli "
                                        "has no cross-layer KV sharing (Gemma 4 E2B/E4B); it runs Gemma 4 31B and "
                                        "26B-A4B")
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise UnsupportedModelError("config.json use_bidirectional_attention=\"all\": llmcli runs causal "
                                        "decoders only")

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        cls.refuse_edge_features(config)

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        config = self.hf_config
        if not getattr(config, "enable_moe_block", False):
            return DecoderModel(spec, backend, max_positions)
        return DecoderModel(spec, backend, max_positions, lambda i: Gemma4MoeMLP(spec, config))
