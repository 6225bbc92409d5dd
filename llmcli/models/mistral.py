"""Mistral (``MistralForCausalLM``): the shared decoder, no biases, no q/k norm. A ``sliding_window`` (Mistral 7B
v0.1: 4096) makes every layer a sliding-window layer; v0.3-style configs have ``sliding_window: null``."""
from __future__ import annotations

from typing import Any

from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        window = getattr(config, "sliding_window", None)
        if not window:
            return DecoderSpec.from_config(config)
        return DecoderSpec.from_config(config, layer_types=("sliding_attention",) * config.num_hidden_layers,
                                       sliding_window=window)

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        """Every config runs exactly: the window is applied, not refused."""
