"""Qwen3-MoE checkpoints: the per-expert tensors reach the stacked parameters, and a missing one is named."""
from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from llmcli import LLM
from llmcli.models.loader import CheckpointError


@pytest.fixture
def moe_top2(tiny_checkpoint):
    return tiny_checkpoint("qwen3-moe-top2")


def test_missing_expert_tensor_is_named(moe_top2, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(moe_top2, broken)
    tensors = load_file(broken / "model.safetensors")
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"missing tensors: {gone.replace('.', '[.]')}$"):
        LLM(str(broken), device="cpu", dtype="float32", num_kvcache_blocks=16, max_model_len=64)


def test_stacked_experts_hold_each_checkpoint_tensor(moe_top2):
    """Expert e's gate rows, then its up rows, in gate_up_proj[e]; its down projection in down_proj[e]."""
    tensors = load_file(moe_top2 / "model.safetensors")
    llm = LLM(str(moe_top2), device="cpu", dtype="float32", num_kvcache_blocks=16, max_model_len=64)
    try:
        experts = llm.engine.model_runner.model.model.layers[0].mlp.experts
        for e in (0, 7):
            prefix = f"model.layers.0.mlp.experts.{e}."
            inter = tensors[prefix + "gate_proj.weight"].shape[0]
            assert experts.gate_up_proj[e, :inter].equal(tensors[prefix + "gate_proj.weight"])
            assert experts.gate_up_proj[e, inter:].equal(tensors[prefix + "up_proj.weight"])
            assert experts.down_proj[e].equal(tensors[prefix + "down_proj.weight"])
        assert not hasattr(llm.engine.model_runner.model.model.layers[1].mlp, "experts")  # mlp_only_layers=[1]
    finally:
        llm.shutdown()
