"""Qwen3 (``Qwen3ForCausalLM``): the shared decoder with a per-head q/k RMSNorm; rotary default or YaRN."""
from __future__ import annotations

from typing import Any

from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(config, qk_norm=True, qkv_bias=bias, o_bias=bias)
