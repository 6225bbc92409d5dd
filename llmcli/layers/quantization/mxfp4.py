"""gpt-oss's MXFP4 expert weights (``quantization_config.quant_method: mxfp4``), dequantized at load (CPU).

A stacked expert tensor ``X`` [E, out, in] is stored as ``X_blocks`` uint8 [E, out, in / 32, 16] (two 4-bit e2m1
values per byte, the low nibble first) and ``X_scales`` uint8 [E, out, in / 32] (an e8m0 exponent per 32 values,
bias 127). Dequantized and transposed it is the 16-bit checkpoint's tensor ([E, in, out]: ``gate_up_proj``
[E, H, 2I], ``down_proj`` [E, I, H]), which the MoE block's loaders take as they take a 16-bit one. The GPU
kernel that would read the 4-bit weights directly does not exist yet; CUDA refuses these checkpoints.
"""
from __future__ import annotations

import torch

from llmcli.layers.quantization.fp8 import QuantizationError

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``X_blocks`` [E, out, G, 16] uint8 and ``X_scales`` [E, out, G] uint8 -> float32 [E, G * 32, out]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                                "expected [E, out, G, 16] and [E, out, G]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [E, out, G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2).transpose(1, 2).contiguous()
