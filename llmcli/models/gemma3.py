"""Gemma 3 text (``Gemma3ForCausalLM``): local (sliding-window) and global layers as config.json's ``layer_types``
lists them, each kind with its own rotary base (``rope_parameters.sliding_attention`` / ``.full_attention``),
zero-centred (1 + w) RMSNorms around both the attention and the GeGLU MLP, per-head q/k norms, the softmax scaled
by ``query_pre_attn_scalar ** -0.5``, embeddings scaled by sqrt(hidden_size), tied lm_head."""
from __future__ import annotations

from typing import Any

from llmcli.layers.rotary import rope_settings
from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec, UnsupportedModelError, layer_types_of


class Gemma3ForCausalLM(DecoderForCausalLM):
    hidden_acts = ("gelu_pytorch_tanh",)  # GeGLU (config_checks reads config.json's hidden_activation against it)

    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(
            config, qk_norm=True, qkv_bias=bias, o_bias=bias, layer_types=layer_types_of(config),
            sliding_window=config.sliding_window, local_rope=rope_settings(config, "sliding_attention"),
            zero_centred_norms=True, query_scale=config.query_pre_attn_scalar ** -0.5,
            embed_scale=config.hidden_size ** 0.5, hidden_act=config.hidden_activation, sandwich_norms=True,
            final_logit_softcap=getattr(config, "final_logit_softcapping", None))

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        if getattr(config, "attn_logit_softcapping", None):
            raise UnsupportedModelError(f"config.json attn_logit_softcapping={config.attn_logit_softcapping}: "
                                        "llmcli's attention has no logit softcapping (Gemma 3 ships it null)")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("config.json use_bidirectional_attention=true: llmcli runs causal "
                                        "decoders only")
