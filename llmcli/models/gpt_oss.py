"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): sliding-window (128) and full layers alternating as
config.json's ``layer_types`` lists them, attention with biases and a learned sink logit per head, YaRN, and a
mixture of experts in every layer (``layers/moe.GptOssMoeBlock``: router with a bias, softmax over the top-k
logits, experts with biases and the clamped SwiGLU). The published MXFP4 checkpoints keep their experts in 4 bits
where the fused MoE kernels run (CUDA; see ``layers/moe.fused_moe_on``); elsewhere they are dequantized at load."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.moe import GptOssMoeBlock, fused_moe_on
from llmcli.layers.quantization.mxfp4 import is_mxfp4
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
        """Every config runs exactly: the windows are applied, not refused (MXFP4 experts: ``config.py`` refuses a
        tensor-parallel split through their 32-value groups)."""

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        c = self.hf_config
        # MXFP4 experts stay packed where the fused kernels run (CUDA); the loop's are dequantized at load
        packed = is_mxfp4(c) and fused_moe_on(torch.get_default_device())

        def make_mlp(layer_index: int) -> nn.Module:
            return GptOssMoeBlock(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                  c.swiglu_alpha, c.swiglu_limit, mxfp4=packed)

        return DecoderModel(spec, backend, max_positions, make_mlp)
