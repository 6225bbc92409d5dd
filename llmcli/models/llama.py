"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (``LlamaForCausalLM``): the shared decoder without q/k norm; ``attention_bias``
and ``mlp_bias`` honoured; rotary default, linear or llama3; head_dim from hidden / heads when absent."""
from __future__ import annotations

from typing import Any

from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(config, qkv_bias=bias, o_bias=bias,
                                       mlp_bias=bool(getattr(config, "mlp_bias", False)))
