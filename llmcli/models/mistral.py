"""Mistral (``MistralForCausalLM``, v0.3-style configs with ``sliding_window: null``): the shared decoder, no
biases, no q/k norm. A non-null sliding window shorter than max_model_len is refused
(decoder.check_no_sliding_window): llmcli never runs it as full attention silently."""
from __future__ import annotations

from typing import Any

from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(config)
