"""The loader's FP8 (and MXFP4) hook: checkpoint scales consumed with their weights, and each linear layer's method
after load.

``Fp8Checkpoint`` sits in ``models/loader.py``'s read loop: it collects every scale tensor first (they are small
and may sit in another shard than their weight), turns each FP8 weight into float32 values before the weight
loader shards it (an MXFP4 ``X_blocks`` with its ``X_scales`` into ``X``'s values: ``mxfp4.py``; on CUDA the
experts take their blocks and scales as stored, which the loader passes by), and says which tensors it
consumed. ``finish_fp8`` then picks each linear layer's method (``fp8.Fp8Linear`` where FP8 GEMMs run, the
dequantized weights elsewhere) and sets the attention layers' FP8 KV-cache scales.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from llmcli.layers.attention import Attention
from llmcli.layers.linear import LinearBase
from llmcli.layers.quantization.fp8 import (FP8_DTYPE, KV_SCALE_SUFFIXES, UNUSED_SUFFIXES, WEIGHT_SCALE_SUFFIXES,
                                            Fp8Linear, QuantConfig, QuantizationError, dequantize,
                                            fp8_compute_available, quantize_per_channel)
from llmcli.layers.quantization.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class Fp8Checkpoint:
    """What one load of an FP8 checkpoint needs: its scales, and which modules came in FP8."""

    def __init__(self, quant: QuantConfig | None, files: list[Path], as_stored: set[str] | None = None) -> None:
        self.quant = quant
        self.mxfp4 = quant is not None and quant.source == "mxfp4"
        as_stored = as_stored or set()  # parameters that take MXFP4 tensors as stored: their scales are not kept
        self.scales: dict[str, torch.Tensor] = {}
        self.kv_scales: dict[int, dict[str, float]] = {}  # layer index -> {"k": ..., "v": ...}
        self.quantized_modules: set[str] = set()  # our (fused) module names that held FP8 weights
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(WEIGHT_SCALE_SUFFIXES) or (
                            self.mxfp4 and name.endswith(SCALES_SUFFIX) and name not in as_stored):
                        self.scales[name] = f.get_tensor(name)
                    elif name.endswith(KV_SCALE_SUFFIXES):
                        self._kv_scale(name, f.get_tensor(name))

    def _kv_scale(self, name: str, t: torch.Tensor) -> None:
        found = _LAYER.search(name)
        if found is None or t.numel() != 1:
            raise QuantizationError(f"checkpoint tensor {name} {tuple(t.shape)}: a KV-cache scale is one float "
                                    "of a numbered layer")
        self.kv_scales.setdefault(int(found.group(1)), {})[name.rsplit(".", 1)[1][0]] = float(t.float().item())

    def consumes(self, name: str) -> bool:
        """Scale tensors are read with their weights (or by ``finish_fp8``), never loaded as parameters."""
        return name.endswith(WEIGHT_SCALE_SUFFIXES + UNUSED_SUFFIXES + KV_SCALE_SUFFIXES) or (
            self.mxfp4 and name.endswith(SCALES_SUFFIX))

    def parameter_name(self, name: str) -> str:
        """The checkpoint name a tensor loads as: an MXFP4 ``X_blocks`` as ``X``, its dequantized values."""
        return name.removesuffix(BLOCKS_SUFFIX) if self.mxfp4 else name

    def values(self, name: str, tensor: torch.Tensor, target: str) -> torch.Tensor:
        """The weight's values to load: an FP8 tensor times its scale (float32), MXFP4 blocks with their scales
        (``mxfp4.dequantize_mxfp4``), any other tensor as it is."""
        if self.mxfp4 and name.endswith(BLOCKS_SUFFIX):
            scales = self.scales.get(name.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX)
            if scales is None:
                raise QuantizationError(f"checkpoint tensor {name} is MXFP4 but has no "
                                        f"{name.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX}")
            try:
                return dequantize_mxfp4(tensor, scales)
            except QuantizationError as exc:
                raise QuantizationError(f"checkpoint tensor {name}: {exc}") from None
        base = name.removesuffix(".weight")
        scale_name = next((base + s for s in WEIGHT_SCALE_SUFFIXES if base + s in self.scales), None)
        if tensor.dtype != FP8_DTYPE:
            if scale_name is not None and name.endswith(".weight"):
                raise QuantizationError(f"checkpoint tensor {name} is {str(tensor.dtype).removeprefix('torch.')} "
                                        f"but has a scale ({scale_name}): only FP8 weights are scaled")
            return tensor
        if self.quant is None:
            raise QuantizationError(f"checkpoint tensor {name} is float8_e4m3fn but config.json has no "
                                    "quantization_config")
        if scale_name is None:
            raise QuantizationError(f"checkpoint tensor {name} is FP8 but has no {base}.weight_scale_inv or "
                                    f"{base}.weight_scale")
        scale = self.scales[scale_name]
        if not scale.is_floating_point():
            raise QuantizationError(f"checkpoint tensor {scale_name} is {str(scale.dtype).removeprefix('torch.')}; "
                                    "weight scales must be floating point")
        try:
            values = dequantize(tensor, scale, self.quant.block_size)
        except QuantizationError as exc:
            raise QuantizationError(f"checkpoint tensor {name}: {exc}") from None
        self.quantized_modules.add(target.removesuffix(".weight"))
        return values


@torch.no_grad()
def finish_fp8(model: nn.Module, quant: QuantConfig | None, loaded: Fp8Checkpoint | None,
               device: torch.device) -> int:
    """After loading: FP8 linear methods where they run, FP8 KV-cache scales; returns the layers made FP8."""
    if loaded is not None and loaded.kv_scales:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for i, s in loaded.kv_scales.items():
            if i < len(layers):
                layers[i].kv_scales = (s.get("k", 1.0), s.get("v", 1.0))
    if quant is None:
        return 0
    fp8_gemm = fp8_compute_available(device)
    converted = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        wanted = name in (loaded.quantized_modules if loaded is not None else set()) or (
            quant.source == "online" and not quant.ignores(name))
        if not wanted:
            continue
        weight = layer.weight
        if fp8_gemm and weight.dtype == torch.bfloat16 and Fp8Linear.fits(weight):
            layer.fp8 = Fp8Linear(weight)
            layer.weight = nn.Parameter(layer.fp8.weight, requires_grad=False)  # the 16-bit copy is freed
            converted += 1
        elif quant.source == "online":  # no FP8 GEMM here: the weights carry e4m3's rounding all the same
            q, scale = quantize_per_channel(weight)
            weight.copy_(q.float() * scale[:, None])
    if converted and device.type == "cuda":
        # the freed 16-bit weights would otherwise stay in the allocator's cache, which the KV-pool probe counts
        # as used (torch.cuda.mem_get_info)
        torch.cuda.empty_cache()
    return converted
