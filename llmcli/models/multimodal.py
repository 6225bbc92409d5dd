"""Language-model-only loading of multimodal checkpoints (Qwen3.5 / Qwen3.5-MoE, Gemma 3 and 4, Mistral 3 with
their vision towers): llmcli runs the text decoder from ``text_config`` and reads only its tensors, mapping the
language model's names onto the causal-LM ones; the vision (and Gemma 4's audio) tower and projector (and
Qwen's multi-token prediction head, ``mtp.*``) are skipped without being read.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("llmcli")

# wrapper architecture -> the causal LM over its text_config
TEXT_MODELS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
}
# both layouts transformers has written: model.language_model.* (5.x) and language_model.model.* (4.x, the
# published Gemma 3 and Mistral 3 checkpoints)
RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
           ("language_model.lm_head.", "lm_head."))
SKIPPED = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
           "multi_modal_projector.", "mtp.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
_told: set[str] = set()


def text_only_config(hf_config: Any, where: str = "") -> Any:
    """``hf_config`` itself, or for a known multimodal wrapper its ``text_config`` posing as the causal LM
    (``architectures`` set, the wrapper's tied-embedding switch carried over); says so once per model."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    wrapper = next((a for a in archs if a in TEXT_MODELS), None)
    text = getattr(hf_config, "text_config", None)
    if wrapper is None or text is None:
        return hf_config
    text.architectures = [TEXT_MODELS[wrapper]]
    text.llmcli_wrapper = wrapper
    if getattr(text, "quantization_config", None) is None and getattr(hf_config, "quantization_config", None):
        text.quantization_config = hf_config.quantization_config
    if not hasattr(text, "tie_word_embeddings") or hasattr(hf_config, "tie_word_embeddings"):
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    if where not in _told:
        _told.add(where)
        log.warning("%s: config.json describes %s; llmcli runs its language model only (%s) and skips the "
                    "vision tower's weights", where or "model", wrapper, TEXT_MODELS[wrapper])
    return text


def language_model_name(name: str) -> str | None:
    """The causal-LM name of checkpoint tensor ``name``; None for a tensor the language model does not use."""
    if name.startswith(SKIPPED):
        return None
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
