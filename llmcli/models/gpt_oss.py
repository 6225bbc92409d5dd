"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): sliding-window (128) and full layers alternating as
config.json's ``layer_types`` lists them, attention with biases and a learned sink logit per head, YaRN, and a
mixture of experts in every layer (``layers/moe.GptOssMoeBlock``: router with a bias, softmax over the top-k
logits, experts with biases and the clamped SwiGLU)."""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.moe import GptOssMoeBlock
from llmcli.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec, layer_types_of


class GptOssForCausalLM(DecoderForCausalLM):
    def __init__(self, config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        self.hf_config = config  # make_model reads the MoE fields, which DecoderSpec does not carry
        super().__init__(config, backend, max_model_len)

    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", True))
        return DecoderSpec.from_config(config, qkv_bias=bias, o_bias=bias, layer_types=layer_types_of(config),
                                       sliding_window=config.sliding_window, attention_sinks=True)

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        """Every config runs exactly: the windows are applied, not refused (MXFP4 experts: ``config.py`` refuses
        them off the CPU, where ``layers/quantization/mxfp4.py`` dequantizes them at load)."""

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        c = self.hf_config

        def make_mlp(layer_index: int) -> nn.Module:
            return GptOssMoeBlock(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                  c.swiglu_alpha, c.swiglu_limit)

        return DecoderModel(spec, backend, max_positions, make_mlp)
