"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the shared decoder with q/k/v bias (none on o_proj), no q/k norm; the
small sizes tie their embeddings. ``use_sliding_window: true`` is refused (decoder.check_no_sliding_window)."""
from __future__ import annotations

from typing import Any

from llmcli.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(config, qkv_bias=True)
