"""Model registry, keyed by the ``architectures`` entry of config.json."""
from __future__ import annotations

from typing import Any

from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.models.qwen3 import Qwen3ForCausalLM
from llmcli.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def build_model(hf_config: Any, backend: AttentionBackend) -> nn.Module:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch](hf_config, backend)
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}; "
                     f"llmcli supports {', '.join(MODEL_REGISTRY)}")
