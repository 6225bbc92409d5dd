"""Quantized weights: how a checkpoint's quantization_config is read, loaded and computed with (FP8 today)."""
from llmcli.layers.quantization.fp8 import QuantConfig, QuantizationError, parse_quant_config

__all__ = ["QuantConfig", "QuantizationError", "parse_quant_config"]
