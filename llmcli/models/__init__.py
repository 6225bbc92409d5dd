"""Model registry, keyed by the ``architectures`` entry of config.json; start-up checks of what a config asks."""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.layers.rotary import rope_settings
from llmcli.models.decoder import DecoderForCausalLM, UnsupportedModelError, head_dim_of
from llmcli.models.gemma3 import Gemma3ForCausalLM
from llmcli.models.gemma4 import Gemma4ForCausalLM
from llmcli.models.gpt_oss import GptOssForCausalLM
from llmcli.models.llama import LlamaForCausalLM
from llmcli.models.mistral import MistralForCausalLM
from llmcli.models.qwen2 import Qwen2ForCausalLM
from llmcli.models.qwen3 import Qwen3ForCausalLM
from llmcli.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from llmcli.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "UnsupportedModelError", "build_model", "check_model_config", "head_dim_of",
           "max_model_positions", "model_class"]


def model_class(hf_config: Any) -> type[DecoderForCausalLM]:
    """The registered class of the first of ``config.architectures`` llmcli knows."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModelError(f"config.json architectures={archs or '(none)'} is not supported; llmcli supports "
                                f"{', '.join(MODEL_REGISTRY)}")


def max_model_positions(hf_config: Any) -> int | None:
    """The longest sequence the model is meant for: max_position_embeddings, stretched by YaRN's factor."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    return rope_settings(hf_config).max_positions(limit) if limit is not None else None


def check_model_config(hf_config: Any, max_model_len: int) -> None:
    """Everything about config.json that would stop the model, checked at start-up before any weight loads:
    the architecture, the rotary scaling, the family's own refusals (a sliding window)."""
    cls = model_class(hf_config)
    cls.spec(hf_config)
    cls.check(hf_config, max_model_len)


def build_model(hf_config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> nn.Module:
    """The model for ``hf_config``, its rotary tables covering ``max_model_len`` positions."""
    return model_class(hf_config)(hf_config, backend, max_model_len)
