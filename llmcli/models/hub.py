"""Finding a model: local folder or hub id, its config.json (and whether llmcli can run what it describes, and its
quantization_config), its EOS ids and its tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcli.layers.quantization import QuantConfig, QuantizationError, parse_quant_config


class ModelNotFoundError(FileNotFoundError):
    """The model argument names neither a usable local folder nor a reachable hub repository."""


def resolve_model_path(model: str, need_weights: bool = True) -> Path:
    """A local folder is used as is; anything else is taken as a hub id and downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(
                f"model folder {path} has no *.safetensors weights; use load_format='dummy' for random weights"
            )
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {model} is not a folder")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.jinja"] + (["*.safetensors"] if need_weights else [])
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as exc:  # network errors come in many classes
        raise ModelNotFoundError(
            f"model {model!r} is not a local folder, and downloading it from the Hugging Face hub failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}). "
            "Without network access, pass the path of a folder holding config.json, *.safetensors and the tokenizer files."
        ) from None


def load_hf_config(model_path: Path) -> Any:
    from transformers import AutoConfig

    from llmcli.models.multimodal import text_only_config

    try:
        config = AutoConfig.from_pretrained(str(model_path))
    except Exception as exc:
        raise ModelNotFoundError(f"{model_path}/config.json could not be read: {exc}") from None
    return text_only_config(config, str(model_path))


def supported_positions(hf_config: Any, max_model_len: int | None) -> int | None:
    """The longest sequence the model allows (max_position_embeddings, stretched by YaRN's factor); with
    ``max_model_len`` also everything else about config.json that would stop the model (architecture, rope type,
    sliding window), so that Config refuses it before any worker starts. Raises ``ValueError`` naming the field
    (``models.UnsupportedModelError``, ``layers.rotary.UnsupportedRopeError``)."""
    from llmcli.models import check_model_config, max_model_positions

    limit = max_model_positions(hf_config)
    if max_model_len is not None:
        check_model_config(hf_config, max_model_len)
    return limit


def load_generation_eos(model_path: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)

    gen = model_path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    return ids


GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: Path) -> dict[str, Any]:
    """Sampling values of generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty)."""
    gen = model_path / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        data = json.loads(gen.read_text())
    except (OSError, ValueError):
        return {}
    return {name: data[name] for name in GENERATION_DEFAULT_FIELDS if data.get(name) is not None}


def load_tokenizer(model_path: Path | str, tokenizer: str | None = None) -> Any | None:
    """The tokenizer (``tokenizer`` if given, else the model folder's), or None when the folder has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer or model_path))
    except Exception as exc:  # transformers raises OSError, ValueError or KeyError for a missing tokenizer
        if tokenizer:
            raise ValueError(f"tokenizer {tokenizer!r} could not be loaded: {exc}") from None
        return None


# QuantizationError is re-exported here for config.py, which may not import the layers itself


def load_quant_config(hf_config: Any, quantization: str | None) -> QuantConfig | None:
    """config.json's quantization_config (with the ``quantization`` setting) as llmcli loads it; None: 16-bit."""
    return parse_quant_config(hf_config, quantization)
