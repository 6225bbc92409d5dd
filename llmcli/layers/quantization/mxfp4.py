"""gpt-oss's MXFP4 expert weights (``quantization_config.quant_method: mxfp4``): the format, and its values.

A stacked expert tensor ``X`` [E, out, in] is stored as ``X_blocks`` uint8 [E, out, in / 32, 16] (two 4-bit e2m1
values per byte, the low nibble first) and ``X_scales`` uint8 [E, out, in / 32] (an e8m0 exponent per 32 values,
bias 127): 4.25 bits a weight. On CUDA the MoE block keeps them so (``layers/moe.GptOssMoeBlock``, packed) and
``kernels/triton_moe_mxfp4.py`` reads them directly; elsewhere the loader dequantizes them at load
(``dequantize_mxfp4``: the 16-bit checkpoint's tensor, which the block's loaders take as they take a 16-bit one).
"""
from __future__ import annotations

import torch

from llmcli.layers.quantization.fp8 import QuantizationError

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
GROUP = 32  # values per scale
BITS_PER_WEIGHT = 4 + 8 / GROUP
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# random dummy weights: any codes; scales 2^-8 .. 2^-6, so the values' spread is near the 16-bit dummies' 0.02
DUMMY_SCALES = (119, 122)


def mxfp4_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values [..., K] of codes [..., K / 2] (or [..., K / 32, 16]) and scales [..., K / 32], any device."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
    values = values.reshape(*scales.shape, GROUP) * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``X_blocks`` [E, out, G, 16] uint8 and ``X_scales`` [E, out, G] uint8 -> float32 [E, G * 32, out]."""
    check_mxfp4(blocks, scales)
    return mxfp4_values(blocks, scales).transpose(1, 2).contiguous()


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """QuantizationError unless ``blocks`` [E, out, G, 16] and ``scales`` [E, out, G] are a pair of uint8 tensors."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                                "expected [E, out, G, 16] and [E, out, G]")


def is_mxfp4(hf_config: object) -> bool:
    """Whether config.json's ``quantization_config`` says MXFP4 (a dict, or transformers' config object)."""
    qc = getattr(hf_config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"
