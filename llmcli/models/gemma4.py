"""Gemma 4 text (``Gemma4ForCausalLM``; ``Gemma4ForConditionalGeneration`` through models/multimodal.py): Gemma 3's
local / global layers, sandwich norms, GeGLU and final-logit softcapping, with

- global layers of their own head size and KV heads (config.json's ``global_head_dim`` and
  ``num_global_key_value_heads``, which transformers keeps as ``per_layer_config``), and K = V there
  (``attention_k_eq_v``: no v_proj, v is the k projection);
- a gain-free RMSNorm on v, plain (w, not 1 + w) norms, softmax scale 1 (folded into q's norm gain);
- proportional rotary on the global layers (``rope_parameters.full_attention``: only the first
  ``partial_rotary_factor`` of each head's angles turn, layers/rotary.py);
- each layer's output times its checkpoint ``layer_scalar``;
- on 26B-A4B (``enable_moe_block``) a routed mixture of experts beside the dense MLP (models/gemma4_moe.py).

The edge models' per-layer input embeddings and cross-layer KV sharing are refused by name."""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.rotary import rope_settings
from llmcli.models.decoder import (
    DecoderForCausalLM, DecoderModel, DecoderSpec, UnsupportedModelError, layer_types_of,
)


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


class Gemma4ForCausalLM(DecoderForCausalLM):
    hidden_acts = ("gelu_pytorch_tanh",)  # GeGLU (config_checks reads config.json's hidden_activation against it)

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
        from llmcli.models.gemma4_moe import Gemma4MoeMLP

        return DecoderModel(spec, backend, max_positions, lambda i: Gemma4MoeMLP(spec, config))
