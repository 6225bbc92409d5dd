"""Filling a model's parameters: safetensors checkpoints (single or sharded) or random dummy weights."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llmcli.layers.quantization.fp8 import QuantConfig, QuantizationError
from llmcli.layers.quantization.loading import Fp8Checkpoint
from llmcli.layers.weight_shape import WeightShapeError, expect_shape
from llmcli.models.model_files import check_readable_file, os_reason, read_json
from llmcli.models.multimodal import language_model_name

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match the model or cannot be read (missing or unexpected tensors, wrong shapes or
    dtypes, a damaged or unreadable file); the message names the file and the tensor."""


def check_weight_file(path: Path) -> None:
    """A weight file must be a readable regular file (a FIFO would block start-up); else CheckpointError."""
    check_readable_file(path, "weight file", CheckpointError)


def read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of model.safetensors.index.json (tensor name -> shard file name), checked."""
    data = read_json(index, CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map object of tensor names and shard file names")
    return weight_map


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / INDEX_NAME
    if index.is_file():
        names = sorted(set(read_index(index).values()))
        missing = [n for n in names if not os.path.lexists(model_path / n)]
        if missing:
            raise CheckpointError(f"{index} names shard files that are absent: {', '.join(missing)}")
        files = [model_path / n for n in names]
    else:
        files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_path}")
    for file in files:
        check_weight_file(file)
    return files


def touch_outside_the_gil(file: Path) -> None:
    """Open ``file`` and read its first page with Python's own calls, which release the GIL while they wait.

    safe_open waits in Rust holding the GIL: a file whose open or first read blocks (a stalled network mount)
    would stall the whole process there, Ctrl-C included. Waiting here instead stalls only the start-up
    thread, and the main thread still takes Ctrl-C."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


@contextmanager
def open_weights(file: Path) -> Iterator[Any]:
    """``safe_open`` with a damaged file (truncated, bad header) or an OS error said as one CheckpointError."""
    try:
        touch_outside_the_gil(file)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        detail = os_reason(exc) if isinstance(exc, OSError) else str(exc)
        raise CheckpointError(f"weight file {file} is damaged or unreadable: {detail}") from None


def _target(name: str, mapping: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for fragment, (fused, shard) in mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def _stacked_names(model: nn.Module) -> dict[str, tuple[str, object]]:
    """Checkpoint name -> (parameter name, shard) for parameters fed by many tensors (MoE experts stacked in one):
    each such parameter lists its tensors' names, relative to its module, in ``checkpoint_shards``."""
    out: dict[str, tuple[str, object]] = {}
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        for relative, shard in getattr(param, "checkpoint_shards", {}).items():
            out[f"{module}.{relative}"] = (name, shard)
    return out


def _expected_checkpoint_names(model: nn.Module) -> set[str]:
    mapping = getattr(model, "packed_modules_mapping", {})
    stacked = _stacked_names(model)
    expected = set(stacked)
    stacked_params = {target for target, _ in stacked.values()}
    for name, param in model.named_parameters():
        if name in stacked_params:
            continue
        fused = [frag for frag, (target, shard) in mapping.items() if f".{target}." in name
                 and shard in getattr(param, "packed_shards", (shard,))]
        if fused:
            expected.update(name.replace(f".{mapping[frag][0]}.", f".{frag}.") for frag in fused)
        else:
            expected.add(name)
    return expected


def load_safetensors(model: nn.Module, model_path: Path, quant: QuantConfig | None = None) -> Fp8Checkpoint:
    """Load every tensor through its parameter's weight_loader; fail listing what does not match.

    FP8 weights (``quant``: config.json's quantization_config) are dequantized with their scales first; the
    returned ``Fp8Checkpoint`` says which modules they were and holds any FP8 KV-cache scales."""
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    stacked = _stacked_names(model)
    tied = getattr(model, "tie_word_embeddings", False)
    seen, unexpected = set(), []
    stored_in: dict[str, Path] = {}  # tensor name -> the shard it was read from: a second copy is refused
    files = checkpoint_files(model_path)
    index = model_path / INDEX_NAME
    weight_map = read_index(index) if index.is_file() else {}
    for file in files:  # every header read first, so a damaged file is named before anything loads
        with open_weights(file):
            pass
    # parameters that take their checkpoint tensors as stored (MXFP4 experts kept in 4 bits: layers/moe_mxfp4.py)
    as_stored = {n for n, p in params.items() if getattr(p, "mxfp4_packed", False)}
    try:
        fp8 = Fp8Checkpoint(quant, files, as_stored)
    except QuantizationError as exc:
        raise CheckpointError(f"checkpoint in {model_path}: {exc}") from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint in {model_path} is damaged or unreadable: {exc}") from None
    for file in files:
        with open_weights(file) as f:
            for stored in f.keys():
                if stored in stored_in:
                    raise CheckpointError(f"tensor {stored} is stored twice, in {stored_in[stored].name} and "
                                          f"{file.name}; a checkpoint holds each tensor once")
                stored_in[stored] = file
                if weight_map.get(stored, file.name) != file.name:
                    raise CheckpointError(f"{INDEX_NAME} puts tensor {stored} in {weight_map[stored]}, but it is "
                                          f"stored in {file.name}")
                name = language_model_name(stored)  # a multimodal checkpoint's language-model names, or None
                raw = name in as_stored
                if name is None or name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight") \
                        or (not raw and fp8.consumes(stored)):
                    continue
                name = name if raw else fp8.parameter_name(name)
                target, shard = stacked.get(name) or _target(name, mapping)
                param = params.get(target)
                if param is None:
                    unexpected.append(name)
                    continue
                try:
                    tensor = f.get_tensor(stored)
                    tensor = tensor if raw else fp8.values(stored, tensor, target)
                except QuantizationError as exc:
                    raise CheckpointError(f"{file.name}: {exc}") from None
                except SafetensorError as exc:
                    raise CheckpointError(f"weight file {file} is damaged: tensor {name}: {exc}") from None
                if raw and tensor.dtype != torch.uint8:
                    raise CheckpointError(f"{file.name}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; "
                                          "MXFP4 blocks and scales are uint8")
                if not raw and not tensor.is_floating_point():
                    raise CheckpointError(f"{file.name}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; "
                                          "weights must be floating point (float32, bfloat16, float16 or FP8)")
                loader = getattr(param, "weight_loader", None)
                try:
                    if loader is None:
                        expect_shape(tensor, param.shape)
                        param.data.copy_(tensor)
                    elif shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                except WeightShapeError as exc:  # as transformers says it
                    raise CheckpointError(f"{file.name}: size mismatch for {name}: {exc}") from None
                except RuntimeError as exc:
                    raise CheckpointError(f"{file.name}: tensor {name} {tuple(tensor.shape)} does not fit "
                                          f"parameter {target} {tuple(param.shape)}: {exc}") from None
                seen.add(name)
    missing = sorted(_expected_checkpoint_names(model) - seen)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:20])}{' …' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:20])}{' …' if len(unexpected) > 20 else ''}")
        raise CheckpointError(f"checkpoint in {model_path} does not match the model: " + "; ".join(parts))
    return fp8


@torch.no_grad()
def load_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights from config.json alone: norms at 1, packed (integer) weights random in their ``dummy_range``,
    everything else small Gaussians."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(getattr(param, "dummy_value", 1.0))  # a zero-centred norm's gain at w = 0
        elif not param.is_floating_point():  # codes and scales of packed weights, in the range each names
            param.random_(*param.dummy_range, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
