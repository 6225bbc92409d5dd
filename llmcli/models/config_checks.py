"""config.json checked in one place, before any weight loads: every size, ratio and value the model is built from.

transformers reads what it is given and fills gaps with its defaults (a missing vocab_size becomes 151,936); the
layers would then broadcast, divide by zero or allocate terabytes. Each check names the file, the field, what it
holds and what it must be; ``ModelConfigError`` is one line on the command line (exit 2).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmcli.models.model_files import json_kind

# What the shared decoder's MLP computes (SwiGLU); a family with another activation names its own in
# ``hidden_acts`` on its model class.
SILU = ("silu", "swish")
POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "moe_intermediate_size")
SCALED_ROPE_FIELDS = ("rope_parameters", "rope_scaling")


class ModelConfigError(ValueError):
    """config.json or generation_config.json holds a value llmcli cannot run; the message names file and field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_config_file(raw: Any, path: Path) -> None:
    """What transformers would trip over with a Python error rather than a message: the shape of the file."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, not {json_kind(raw)}")
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ModelConfigError(f"{path}: architectures={archs!r} must be a list of class names, e.g. "
                               '["Qwen3ForCausalLM"]')
    for name in ("torch_dtype", "dtype"):
        if raw.get(name) == "auto":
            raise ModelConfigError(f"{path}: {name}='auto' is not a dtype; give the checkpoint's (e.g. \"bfloat16\") "
                                   "or leave the field out")
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelConfigError(f"{path}: quantization_config={quant!r} must be a JSON object, e.g. "
                               '{"quant_method": "fp8", "weight_block_size": [128, 128]}')


def check_config_values(config: Any, raw: dict, path: Path, hidden_acts: tuple[str, ...] | None = SILU) -> None:
    """Sizes, ratios, activation, vocabulary, rotary and mixture-of-experts values of a loaded config.

    ``raw`` is config.json as written (to tell a value given from transformers' default); ``hidden_acts``:
    the activations the model class runs (None: not known here, the architecture check speaks later)."""

    def fail(field: str, why: str) -> ModelConfigError:
        return ModelConfigError(f"{path}: {field}={getattr(config, field, None)!r} {why}")

    # a multimodal config keeps its text model's fields in text_config, where the family reads them
    if "vocab_size" not in raw and "text_config" not in raw:
        raise ModelConfigError(f"{path} gives no vocab_size (the number of rows of the embedding); add it")
    for field in POSITIVE_SIZES:
        value = getattr(config, field, None)
        if value is not None and (not _is_int(value) or value < 1):
            raise fail(field, "must be a positive integer")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise fail("num_key_value_heads", f"must divide num_attention_heads={heads} (each KV head serves a whole "
                                          "group of query heads)")
    head_dim, hidden = getattr(config, "head_dim", None), getattr(config, "hidden_size", None)
    if head_dim is not None and (not _is_int(head_dim) or head_dim < 0):
        raise fail("head_dim", "must be a positive integer (or left out: hidden_size / num_attention_heads)")
    if not head_dim and heads and hidden and hidden % heads:
        raise fail("hidden_size", f"must be a multiple of num_attention_heads={heads} when head_dim is not given")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and (not _is_int(positions) or positions < 0):
        raise fail("max_position_embeddings", "must be a positive integer")
    eps = getattr(config, "rms_norm_eps", None)
    if eps is not None and (not _is_number(eps) or not math.isfinite(eps) or eps <= 0):
        raise fail("rms_norm_eps", "must be a small positive number, e.g. 1e-06")
    # Gemma names its MLP's activation hidden_activation (and leaves hidden_act unset)
    act_field = "hidden_activation" if getattr(config, "hidden_activation", None) is not None else "hidden_act"
    act = getattr(config, act_field, None)
    if hidden_acts is not None and act is not None and act not in hidden_acts:
        raise fail(act_field, f"is not what this model runs; llmcli implements {', '.join(hidden_acts)} here")
    _check_experts(config, fail)
    _check_rope(config, path)


def _check_experts(config: Any, fail: Any) -> None:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None or experts is None:
        return
    if not _is_int(top_k) or not 1 <= top_k <= experts:
        raise fail("num_experts_per_tok", f"must be from 1 to the number of experts ({experts})")


def _check_rope(config: Any, path: Path) -> None:
    """rope_theta (top-level or in rope_parameters) and a scaling factor: finite and above 0."""
    for field in SCALED_ROPE_FIELDS:
        params = getattr(config, field, None)
        if not isinstance(params, dict):
            continue
        for key in ("rope_theta", "factor"):
            value = params.get(key)
            if value is not None and (not _is_number(value) or not math.isfinite(value) or value <= 0):
                raise ModelConfigError(f"{path}: {field}.{key}={value!r} must be a positive number")
    theta = getattr(config, "rope_theta", None)
    if theta is not None and (not _is_number(theta) or not math.isfinite(theta) or theta <= 0):
        raise ModelConfigError(f"{path}: rope_theta={theta!r} must be a positive number, e.g. 1000000.0")
