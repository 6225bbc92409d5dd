"""FP8 weights: the published checkpoint formats, dequantizing them at load, and the sm90 FP8 linear method.

Formats read from config.json's ``quantization_config`` (``parse_quant_config``):

* Qwen / DeepSeek block FP8: ``quant_method: fp8`` with ``weight_block_size: [128, 128]``; each linear weight is
  e4m3 with a ``weight_scale_inv`` of one float per 128x128 block (a dimension that is not a multiple of 128
  ends in a partial block). Despite the name, value = fp8 * weight_scale_inv.
* vLLM per-tensor FP8: ``quant_method: fp8`` without a block size; ``weight_scale`` one float per tensor,
  an optional static ``input_scale``.
* compressed-tensors FP8: ``quant_method: compressed-tensors`` whose config groups have 8-bit float weights,
  strategy ``channel`` (``weight_scale`` [out, 1]), ``tensor`` or ``block``; an ``ignore`` list.

Every checkpoint weight is dequantized to float32 in full before its parameter's weight loader takes this rank's
tensor-parallel shard, so a weight and its scales are always sharded together (a block-scale row goes with the
128 rows it scales) whatever the split. Unquantized tensors (embeddings, lm_head, norms, ``ignore`` /
``modules_to_not_convert``) arrive in the model dtype and load as usual.

Compute: on sm90 and later (``fp8_compute_available``) every linear layer that held FP8 weights (or every one,
with ``quantization='fp8'`` on a 16-bit checkpoint) is converted after loading to e4m3 weights with one scale
per output channel, and runs ``torch._scaled_mm`` on activations quantized per token at run time (row-wise
scales: ``Fp8Linear``). Block-scaled weights are re-quantized per channel there: one more e4m3 rounding of each
weight (at most 1/16 relative), traded for cuBLAS's row-wise FP8 GEMM, which every torch >= 2.5 has on sm90
(block-wise scales need newer torch and a DeepGEMM-style kernel; the GPU run's agreement gate measures the
trade). Static ``input_scale`` values are not used: per-token dynamic scales are at least as accurate.
Elsewhere (CPU, older GPUs) the dequantized weights stay in the compute dtype, so every machine loads every
FP8 checkpoint (``quantization='fp8'`` there rounds each weight through e4m3 and back, so the numbers match).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# checkpoint tensors that are scales of a weight (consumed with it) or static activation scales (unused)
WEIGHT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
UNUSED_SUFFIXES = (".input_scale",)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


class QuantizationError(ValueError):
    """config.json's quantization_config (or a checkpoint's scales) is something llmcli cannot load."""


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear weights are (or are to be) stored in FP8."""

    source: str  # "fp8" (Qwen/vLLM), "compressed-tensors", "online" (quantization='fp8' on a 16-bit checkpoint),
    # or "mxfp4" (gpt-oss's 4-bit experts, dequantized at load)
    block_size: tuple[int, int] | None = None  # (rows, cols) per weight scale; None: per tensor or per channel
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns left in the model dtype
    kv_scales: bool = False  # the checkpoint may carry k_scale / v_scale for an FP8 KV cache
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def ignores(self, module: str) -> bool:
        """Whether ``module`` (e.g. ``model.layers.0.mlp.down_proj``, or a fused name's checkpoint parts) stays
        unquantized: an exact name, a name ending in ``.entry``, or an ``re:`` pattern (compressed-tensors)."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def parse_quant_config(hf_config: Any, quantization: str | None) -> QuantConfig | None:
    """The FP8 configuration of a model, from its ``quantization_config`` and the ``quantization`` setting."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    archs = getattr(hf_config, "architectures", None) or []
    if (qc or quantization) and any("Moe" in a for a in archs):
        raise QuantizationError(f"config.json: FP8 weights of a mixture-of-experts model ({archs[0]}) are not "
                                "supported yet; use the 16-bit checkpoint")
    if not qc:
        return QuantConfig(source="online") if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise QuantizationError(f"config.json quantization_config.weight_block_size={block!r}: expected "
                                    "[rows, cols], e.g. [128, 128]")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise QuantizationError(f"config.json quantization_config.fmt={qc['fmt']!r}: only e4m3 FP8 loads")
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        return QuantConfig("fp8", tuple(block) if block else None, ignore, kv_scales=True)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss's experts, dequantized at load (layers/quantization/mxfp4.py)
        return QuantConfig("mxfp4")
    raise QuantizationError(f"config.json quantization_config.quant_method={method!r}: llmcli loads 'fp8' and "
                            "'compressed-tensors' (FP8) checkpoints")


def _compressed_tensors(qc: dict) -> QuantConfig:
    block = None
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        where = f"config.json quantization_config.config_groups.{name}.weights"
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise QuantizationError(f"{where}: num_bits={w.get('num_bits')!r} type={w.get('type')!r}; llmcli loads "
                                    "8-bit float (FP8) weights only")
        strategy = w.get("strategy")
        if strategy == "block":
            block = tuple(w.get("block_structure") or (128, 128))
        elif strategy not in ("channel", "tensor"):
            raise QuantizationError(f"{where}.strategy={strategy!r}: llmcli loads channel, tensor or block")
    return QuantConfig("compressed-tensors", block, tuple(qc.get("ignore") or ()),
                       kv_scales=bool(qc.get("kv_cache_scheme")))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 values of an FP8 ``weight`` [out, in]: times a per-tensor, per-output-channel ([out] or
    [out, 1]) or per-block ([ceil(out / rows), ceil(in / cols)]) ``scale``; a partial last block is cut."""
    w = weight.float()
    s = scale.float()
    rows, cols = w.shape
    one_block = block is None or (rows <= block[0] and cols <= block[1])
    if s.numel() == 1 and one_block:  # a lone scale where a block grid is due would broadcast: refused below
        return w * s.reshape(())
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1 and s.shape[0] == rows and block is None):
        if s.numel() != rows:
            raise QuantizationError(f"a per-channel scale of {s.numel()} values for a weight of {rows} rows")
        return w * s.reshape(rows, 1)
    if block is None:
        raise QuantizationError(f"a weight scale of shape {tuple(s.shape)} for a weight of {tuple(w.shape)} needs "
                                "a block size (weight_block_size) in quantization_config")
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(s.shape) != want:
        raise QuantizationError(f"a block scale of shape {tuple(s.shape)} for a weight of {tuple(w.shape)} in "
                                f"{br}x{bc} blocks; expected {want}")
    full = s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return w * full


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights and their float32 per-output-channel scales ([out]): each row's largest magnitude maps to
    448 (an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 activations and float32 per-row scales ([rows, 1]), for the row-wise scaled GEMM: on CUDA one Triton
    kernel (``kernels/triton_fp8_quant.py``), elsewhere these torch ops, which compute the same."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        from llmcli.kernels.triton_fp8_quant import quantize_rows

        return quantize_rows(x)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_compute_available(device: torch.device) -> bool:
    """Row-wise scaled FP8 GEMMs run here: CUDA sm90 or later (Hopper's FP8 tensor cores with cuBLASLt's
    row-wise scaling; Ada's sm89 has FP8 but not row-wise scales in torch's _scaled_mm)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and hasattr(torch, "_scaled_mm"))


class Fp8Linear:
    """The FP8 linear method of one layer: e4m3 weights [out, in] with per-channel scales, per-token activations."""

    def __init__(self, weight: torch.Tensor) -> None:
        q, scale = quantize_per_channel(weight)
        self.weight = q  # [out, in] row-major: its transpose is the column-major operand _scaled_mm wants
        self.scale = scale.view(1, -1).contiguous()

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """cuBLASLt's FP8 GEMM wants both dimensions multiples of 16."""
        return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_per_token(x2)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, bias=bias, out_dtype=x.dtype)
        return y.view(*shape[:-1], y.shape[-1])
