"""Finding a model: local folder or hub id, its config.json (and whether llmcli can run what it describes, and its
quantization_config), its EOS ids and its tokenizer."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from llmcli.layers.moe_mxfp4 import check_mxfp4_split
from llmcli.layers.quantization import QuantConfig, QuantizationError, parse_quant_config
from llmcli.models.model_files import check_readable_file, json_kind, read_json


class ModelNotFoundError(FileNotFoundError):
    """The model argument names neither a usable local folder nor a reachable hub repository."""


def _weights_missing(path: Path) -> str:
    """Why a model folder has no weights llmcli loads: it cannot be listed, or it holds pickle checkpoints."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        return f"cannot list model folder {path}: {(exc.strerror or str(exc)).lower()}"
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    if pickles:
        return (f"model folder {path} has {pickles[0]} but no *.safetensors: llmcli does not load pickle "
                "checkpoints; convert them (e.g. transformers' save_pretrained(..., safe_serialization=True))")
    return (f"model folder {path} has no *.safetensors weights (for random weights from config.json alone: "
            "--load-format dummy, load_format='dummy' in Python)")


def resolve_model_path(model: str, need_weights: bool = True) -> Path:
    """A local folder is used as is; anything else is taken as a hub id and downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            if need_weights and not os.access(path, os.R_OK):
                raise ModelNotFoundError(_weights_missing(path))
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(_weights_missing(path))
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {model} is not a folder")
    patterns = ["*.json", "*.txt", "*.model", "*.jinja"] + (["*.safetensors"] if need_weights else [])
    return _download(model, patterns, "model", "config.json, *.safetensors and the tokenizer files")


def _download(repo: str, patterns: list[str], what: str, needs: str) -> Path:
    """One try at the hub (no retries: without network it fails in about a second), said in one line."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except Exception as exc:  # network errors come in many classes
        raise ModelNotFoundError(
            f"{what} {repo!r} is not a local folder, and downloading it from the Hugging Face hub failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}). "
            f"Without network access, pass the path of a folder holding {needs}."
        ) from None


def load_hf_config(model_path: Path) -> Any:
    """config.json read by transformers and checked (``config_checks``: ModelConfigError names the field)."""
    from transformers import AutoConfig

    from llmcli.models.config_checks import check_config_file, check_config_values
    from llmcli.models.multimodal import text_only_config

    path = model_path / "config.json"
    raw = read_json(path, ModelNotFoundError)
    check_config_file(raw, path)
    try:
        config = AutoConfig.from_pretrained(str(model_path))
    except Exception as exc:
        raise ModelNotFoundError(f"{model_path}/config.json could not be read: {exc}") from None
    # a multimodal wrapper's language model (text_config) is what runs, so its values are the ones checked
    config = text_only_config(config, str(model_path))
    if getattr(config, "per_layer_config", None) is not None:
        # transformers keeps layers of their own shape (Gemma 4's global ones) in per_layer_config and guards the
        # top-level head_dim / num_key_value_heads; in llmcli those are the common layers' (the families read
        # per_layer_config for the others), so transformers' warning on each such read says nothing to a user
        config.allow_global_per_layer_attribute_access = True
        logging.getLogger("transformers.integrations.heterogeneity.configuration_utils").setLevel(logging.ERROR)
    check_config_values(config, raw, path, _hidden_acts(config))
    return config


def _hidden_acts(config: Any) -> tuple[str, ...] | None:
    """The activations the registered class of ``config`` runs (None for an architecture llmcli lacks)."""
    from llmcli.models import MODEL_REGISTRY
    from llmcli.models.config_checks import SILU

    cls = next((MODEL_REGISTRY[a] for a in getattr(config, "architectures", None) or [] if a in MODEL_REGISTRY), None)
    return None if cls is None else getattr(cls, "hidden_acts", SILU)


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


def read_generation_config(model_path: Path) -> dict[str, Any]:
    """generation_config.json as a dict ({} without one); one ModelConfigError if it cannot be read or parsed."""
    from llmcli.models.config_checks import ModelConfigError

    gen = model_path / "generation_config.json"
    if not os.path.lexists(gen):
        return {}
    data = read_json(gen, ModelConfigError, "; fix or remove it")
    if not isinstance(data, dict):
        raise ModelConfigError(f"{gen} must hold a JSON object, not {json_kind(data)}; fix or remove it")
    return data


def load_generation_eos(model_path: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    from llmcli.models.config_checks import ModelConfigError

    ids: list[int] = []

    def add(value: Any, where: str) -> None:
        if value is None:
            return
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, bool):  # an int to Python, never a token id
                raise ModelConfigError(f"{where}: eos_token_id={json.dumps(value)} is not a token id; give an "
                                       "integer or a list of them")
            if isinstance(item, int) and item not in ids:
                ids.append(item)

    add(read_generation_config(model_path).get("eos_token_id"), str(model_path / "generation_config.json"))
    add(getattr(hf_config, "eos_token_id", None), str(model_path / "config.json"))
    return ids


GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: Path) -> dict[str, Any]:
    """Sampling values of generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), each
    checked as a request's would be; a bad one is blamed on the file, not on a flag the user never gave."""
    from llmcli.models.config_checks import ModelConfigError
    from llmcli.sampling_params import SamplingParams, SamplingParamsError

    data = read_generation_config(model_path)
    values = {name: data[name] for name in GENERATION_DEFAULT_FIELDS if data.get(name) is not None}
    for name, value in values.items():
        why = None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (name == "top_k" and
                                                                              not isinstance(value, int)):
            why = "must be an integer" if name == "top_k" else "must be a number"
        else:
            try:
                SamplingParams(**{name: value})
            except SamplingParamsError as exc:
                why = re.sub(r"^SamplingParams\.\w+: | \(got .*\)$", "", str(exc))
        if why is not None:
            raise ModelConfigError(f"{model_path / 'generation_config.json'}: {name}={json.dumps(value)} {why} (fix "
                                   "the file, or pass --generation-config ignore (generation_config='ignore' in "
                                   "Python) to leave it unread)")
    return values


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")


def resolve_tokenizer_path(tokenizer: str) -> Path:
    """--tokenizer: a local folder as is, else a hub id fetched once (the path --model takes: no retries)."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    if path.exists() or tokenizer.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"tokenizer path {tokenizer} is not a folder")
    return _download(tokenizer, ["*.json", "*.txt", "*.model", "*.jinja"], "tokenizer", "the tokenizer files")


def load_tokenizer(model_path: Path | str, tokenizer: str | None = None) -> Any | None:
    """The tokenizer (``tokenizer`` if given, else the model folder's), or None when the folder has no tokenizer
    files. Files that are there but do not load are an error naming them (ModelConfigError), never "no
    tokenizer": token-id records would otherwise come back with empty texts."""
    from transformers import AutoTokenizer

    from llmcli.models.config_checks import ModelConfigError

    folder = resolve_tokenizer_path(tokenizer) if tokenizer else Path(model_path)
    present = [folder / n for n in TOKENIZER_FILES if os.path.lexists(folder / n)]
    if not present:  # a rarer format may still load; transformers' empty stand-in (one token) is no tokenizer
        try:
            loaded = AutoTokenizer.from_pretrained(str(folder))
        except Exception:
            loaded = None
        if loaded is None or len(loaded) <= 1:
            if tokenizer:
                raise ModelNotFoundError(f"--tokenizer {tokenizer}: {folder} holds no tokenizer files "
                                         f"({', '.join(TOKENIZER_FILES[:2])}, ...)")
            return None
        return loaded
    for file in present:  # before transformers opens them: a FIFO would block, EACCES would read as "missing"
        check_readable_file(file, "tokenizer file", ModelConfigError)
    try:
        loaded = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a broken tokenizer
        for file in present:
            _check_tokenizer_json(file)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError(f"the tokenizer in {folder} ({', '.join(f.name for f in present)}) could not be "
                               f"loaded: {detail}") from None
    return loaded


def _check_tokenizer_json(file: Path) -> None:
    from llmcli.models.config_checks import ModelConfigError

    if file.suffix == ".json":
        read_json(file, ModelConfigError)


# QuantizationError is re-exported here for config.py, which may not import the layers itself


def load_quant_config(hf_config: Any, quantization: str | None) -> QuantConfig | None:
    """config.json's quantization_config (with the ``quantization`` setting) as llmcli loads it; None: 16-bit."""
    return parse_quant_config(hf_config, quantization)


def mxfp4_split_problem(hf_config: Any, tensor_parallel_size: int) -> str | None:
    """Why ``tensor_parallel_size`` ranks cannot share MXFP4 experts kept packed (on CUDA); None: they can."""
    return check_mxfp4_split(hf_config.intermediate_size, tensor_parallel_size)
