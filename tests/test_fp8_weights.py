"""FP8 weights: published checkpoint formats and quantization='fp8' against transformers on the dequantized weights.

The tiny models have dims that are not multiples of 128 (hidden 192, MLP 320, k/v 64 rows), so Qwen's 128x128
scale blocks are partial at the edges, and tensor parallelism splits the MLP's 320 rows mid-block (160 a rank).
The oracle is HF in float32 on the dequantized weights (``fp8_checkpoints``: fp8 * scale as the formats define
it), through chunked prefill (24-token steps), prefix-cache hits and TP=2.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import round_through_fp8, write_fp8
from test_tensor_parallel import assert_same_tokens
from tiny_qwen3 import write_tiny_model

from llmcli import LLM, SamplingParams
from llmcli.config import Config, ConfigError
from llmcli.models.loader import CheckpointError

MAX_NEW = 10
TINY = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
CASES = [("qwen3", "block"), ("qwen3", "channel"), ("llama", "channel")]
two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    return {family: write_tiny_model(tmp_path_factory.mktemp(f"fp8_base_{family}"), family, seed=21, **TINY,
                                     **({"head_dim": 32} if family == "qwen3" else {}))
            for family in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def fp8_pairs(bases, tmp_path_factory):
    """``fp8_pairs(family, fmt)``: the (FP8 checkpoint, dequantized HF twin) folders, written once per module."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, fmt: str) -> tuple[Path, Path]:
        if (family, fmt) not in made:
            root = tmp_path_factory.mktemp(f"fp8_{family}_{fmt}")
            made[family, fmt] = write_fp8(bases[family], root / "fp8", root / "hf", fmt)
        return made[family, fmt]
    return get


def prompts_with_shared_prefixes() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, 500, (45,), generator=g).tolist()
    return [first, first[:33] + torch.randint(3, 500, (7,), generator=g).tolist(), first[:40],
            torch.randint(3, 500, (19,), generator=g).tolist()]


def run(model: Path, **overrides) -> list[list[int]]:
    """Greedy tokens; the first prompt alone first, so the others hit its cached blocks."""
    kwargs = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
                  max_num_batched_tokens=24, max_num_seqs=8, max_model_len=256, enforce_eager=True)
    kwargs.update(overrides)
    prompts = prompts_with_shared_prefixes()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(model), **kwargs) as llm:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    return [o.outputs[0].token_ids for o in first + rest]


@pytest.mark.parametrize("family,fmt", CASES)
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(family, fmt, fp8_pairs, hf_oracle):
    fp8_dir, hf_dir = fp8_pairs(family, fmt)
    assert load_file(str(fp8_dir / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].dtype == \
        torch.float8_e4m3fn
    prompts = prompts_with_shared_prefixes()
    assert_same_tokens(hf_oracle, hf_dir, prompts, run(fp8_dir), hf_oracle.greedy(hf_dir, prompts, MAX_NEW),
                       f"{fp8_dir.parent.name} TP=1")


@two_cores
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_checkpoint_tp2_matches_hf(fmt, fp8_pairs, hf_oracle):
    fp8_dir, hf_dir = fp8_pairs("qwen3", fmt)  # one family is enough for the TP split of weights and scales
    prompts = prompts_with_shared_prefixes()
    assert_same_tokens(hf_oracle, hf_dir, prompts, run(fp8_dir, tensor_parallel_size=2),
                       hf_oracle.greedy(hf_dir, prompts, MAX_NEW), f"{fp8_dir.parent.name} TP=2")


def test_quantization_fp8_rounds_each_weight_through_e4m3(bases, tmp_path, hf_oracle):
    """CPU has no FP8 GEMM: quantization='fp8' must give the model whose weights went through per-channel e4m3."""
    hf_dir = round_through_fp8(bases["qwen3"], tmp_path / "rounded")
    prompts = prompts_with_shared_prefixes()
    got = run(bases["qwen3"], quantization="fp8")
    assert_same_tokens(hf_oracle, hf_dir, prompts, got, hf_oracle.greedy(hf_dir, prompts, MAX_NEW), "online fp8")
    assert got != hf_oracle.greedy(bases["qwen3"], prompts, MAX_NEW), "the rounding changed nothing: test is blind"


def test_fp8_gemm_equals_the_dequantized_matmul():
    """Fp8Linear (torch._scaled_mm, row-wise scales; CPU torch runs it too) against the matmul of the dequantized
    operands, in float32: only the GEMM's own accumulation and output rounding differ."""
    from llmcli.layers.quantization.fp8 import Fp8Linear, quantize_per_token

    w = torch.randn(96, 160)
    x = torch.randn(7, 160, dtype=torch.bfloat16) * 3
    layer = Fp8Linear(w)
    got = layer.apply(x, None).float()
    xq, xs = quantize_per_token(x)
    want = (xq.float() * xs) @ (layer.weight.float() * layer.scale.view(-1, 1)).t()
    assert ((got - want).norm() / want.norm()).item() < 8e-3  # bf16 output: 2^-8 relative per element


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_fp8_checkpoint_errors_name_the_tensor_or_field(fp8_pairs, tmp_path):
    import shutil

    fp8_dir, _ = fp8_pairs("qwen3", "block")
    broken = shutil.copytree(fp8_dir, tmp_path / "no_scale")
    state = load_file(str(broken / "model.safetensors"))
    scale = next(n for n in state if n.startswith("model.layers.1.mlp.up_proj.weight_scale"))
    del state[scale]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is FP8 but has no"):
        LLM(str(broken), device="cpu", num_kvcache_blocks=8, enforce_eager=True)

    odd = shutil.copytree(fp8_dir, tmp_path / "awq")
    _edit_config(odd, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ConfigError, match=r"quant_method='awq'.*'fp8' and 'compressed-tensors'"):
        Config(str(odd), device="cpu")

    moe = shutil.copytree(fp8_dir, tmp_path / "moe")
    _edit_config(moe, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        Config(str(moe), device="cpu")


def test_vllm_per_tensor_format_and_the_ignore_list():
    """vLLM's per-tensor ``fp8`` (one ``weight_scale`` per tensor) and the names an ``ignore`` list keeps 16-bit."""
    from types import SimpleNamespace

    from llmcli.layers.quantization.fp8 import dequantize, parse_quant_config

    cfg = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={
        "quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]})
    quant = parse_quant_config(cfg, None)
    assert quant.block_size is None and quant.source == "fp8"
    assert quant.ignores("lm_head") and quant.ignores("model.layers.0.mlp.down_proj")
    assert not quant.ignores("model.layers.10.mlp.down_proj") and not quant.ignores("model.layers.0.mlp.gate_up_proj")
    ct = SimpleNamespace(architectures=["Qwen3ForCausalLM"], quantization_config={
        "quant_method": "compressed-tensors", "ignore": ["re:.*layers\\.1\\..*"],
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}})
    quant = parse_quant_config(ct, None)
    assert quant.ignores("model.layers.1.self_attn.qkv_proj") and not quant.ignores("model.layers.11.self_attn.qkv_proj")
    w = (torch.randn(8, 12) * 50).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(w, torch.tensor(0.37)), w.float() * 0.37)
    assert torch.equal(dequantize(w, torch.tensor([0.37])), w.float() * 0.37)
