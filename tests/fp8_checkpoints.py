"""Writers of tiny FP8 checkpoints in the published formats, each with the dequantized model beside it for HF.

Written here, independently of llmcli's loader: the quantization below is the formats' definition (e4m3 of the
weight divided by a scale; the scale stored per 128x128 block as ``weight_scale_inv`` (Qwen), per output
channel as ``weight_scale`` [out, 1] (compressed-tensors)), computed with torch's own float8_e4m3fn cast. The
HF folder holds exactly fp8 * scale in float32, which is what a correct loader must compute.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / E4M3_MAX
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = _quantize(w, full)
    return q, scale, q.float() * full


def _channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    q = _quantize(w, scale)
    return q, scale, q.float() * scale


def write_fp8(src: Path, fp8_dir: Path, hf_dir: Path, fmt: str) -> tuple[Path, Path]:
    """``fmt``: ``block`` (Qwen's ``quant_method: fp8``, 128x128) or ``channel`` (compressed-tensors). Writes the
    FP8 checkpoint to ``fp8_dir`` and its dequantized float32 twin to ``hf_dir``; returns both."""
    for d in (fp8_dir, hf_dir):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    fp8_state, hf_state = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            q, scale, deq = _block(t.float()) if fmt == "block" else _channel(t.float())
            fp8_state[name] = q
            fp8_state[module + (".weight_scale_inv" if fmt == "block" else ".weight_scale")] = scale
            hf_state[name] = deq
        else:
            fp8_state[name] = hf_state[name] = t
    save_file(fp8_state, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(hf_state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    if fmt == "block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [128, 128]}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, hf_dir


def round_through_fp8(src: Path, hf_dir: Path) -> Path:
    """A copy of ``src`` whose linear weights are rounded through per-channel e4m3 (``quantization='fp8'``)."""
    shutil.copytree(src, hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    for name, t in state.items():
        if name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS:
            state[name] = _channel(t.float())[2].to(t.dtype)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_dir
