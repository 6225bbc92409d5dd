"""Gemma 4 beyond the family matrix (tests/test_new_families.py runs the tiny dense, MoE and multimodal-wrapper
checkpoints against transformers): prefix hits over layers of two head sizes, the KV pool's groups of layers of
two shapes sharing one slab per block id, the edge models' features refused by name, and the MoE block's router
and GeGLU experts against transformers' own modules."""
from __future__ import annotations

import pytest
import torch

from test_engine_vs_hf import check_against_hf, random_prompts, run_factory  # noqa: F401 (a fixture)
from test_model_checks import _copy, _edit_config, _llm


def test_prefix_hits_across_local_and_global_layers(tiny_checkpoint, hf_oracle, run_factory):
    """A repeated long prompt reuses its cached blocks in both kinds of layer (16-wide local and 32-wide
    global heads) and still gives transformers' tokens; the local layer is a window group of its own, so a block
    id is one layer's K and V (both kinds' are the same size here)."""
    model = tiny_checkpoint("gemma4-moe")
    prompts = random_prompts([80, 33], seed=450)
    run = run_factory(model, kvcache_block_size=16, max_model_len=256)
    check_against_hf(run, hf_oracle, prompts, max_new=8)
    check_against_hf(run, hf_oracle, prompts, max_new=8)
    assert run.llm.engine.stats.prefix_cache_hit_tokens > 0
    # K and V, float32: a local layer of 4 x 16 or a global one of 2 x 32 (tests/tiny_qwen3.py GEMMA4)
    report = run.llm.engine.model_runner.memory_report
    assert report.kv_bytes_per_token == 2 * 4 * 4 * 16 == 2 * 4 * 2 * 32
    assert [g["window"] for g in report.kv_groups] == [None, 24]


@pytest.mark.parametrize("block_size", [16, 64])
def test_window_groups_of_two_shapes_through_chunks_preemption_and_prefix_hits(tiny_checkpoint, hf_oracle,
                                                                                run_factory, block_size):
    """The dense checkpoint (two local layers of 4 x 16, two global ones of 1 x 32 side by side in one slab, three
    KV groups) over prompts up to ten windows long: 20-token chunks, a pool of a few sequences' blocks (so
    sequences are preempted, and window blocks go back and are handed out again), prompts sharing a prefix, then
    some of them once more, from the prefix cache; transformers' tokens every time."""
    model = tiny_checkpoint("gemma4")
    shared = random_prompts([130], seed=451)[0]
    prompts = [shared + tail for tail in random_prompts([3, 40, 90], seed=452)] + random_prompts([60, 200], seed=453)
    # the longest request's blocks (28 / 10) and a few more; at 16 a pool this small preempts (from 32 on, prompts
    # scheduled together share the prefix blocks of the step that computes them, and nothing has to give way)
    blocks = {16: 30, 64: 11}[block_size]
    run = run_factory(model, kvcache_block_size=block_size, num_kvcache_blocks=blocks, max_model_len=256,
                      max_num_batched_tokens=20)
    report = run.llm.engine.model_runner.memory_report
    assert [g["window"] for g in report.kv_groups] == [None, 24, 24]
    check_against_hf(run, hf_oracle, prompts, max_new=24)
    stats = run.llm.engine.stats
    assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    before = stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts[:3], max_new=24)
    assert run.llm.engine.stats.prefix_cache_hit_tokens > before > 0


@pytest.mark.parametrize("field,value", [("hidden_size_per_layer_input", 16), ("num_kv_shared_layers", 2)])
def test_edge_model_features_are_refused_naming_the_field(tiny_checkpoint, tmp_path, field, value):
    from llmcli.config import ConfigError

    folder = _edit_config(_copy(tiny_checkpoint("gemma4"), tmp_path), lambda cfg: cfg.update({field: value}))
    with pytest.raises(ConfigError, match=rf"config.json {field}={value}: llmcli has no ") as refused:
        _llm(folder)
    assert "\n" not in str(refused.value)


def test_router_and_experts_match_transformers():
    """Router (gain-free norm, learned scale, renormalised top-k times per-expert scales) and tanh-GELU experts
    over stacked weights, against Gemma4TextRouter and Gemma4TextExperts with the same random weights."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    from llmcli.kernels.moe_reference import moe_reference
    from llmcli.models.gemma4 import Gemma4Router

    torch.manual_seed(0)
    config = Gemma4TextConfig(hidden_size=48, num_experts=8, top_k_experts=3, moe_intermediate_size=24,
                              hidden_size_per_layer_input=0, num_hidden_layers=6, enable_moe_block=True)
    router, experts = Gemma4TextRouter(config).eval(), Gemma4TextExperts(config).eval()
    with torch.no_grad():
        for param in (*router.parameters(), *experts.parameters()):
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.3)
    ours = Gemma4Router(48, 8, 3, config.rms_norm_eps)
    ours.load_state_dict(router.state_dict())
    x = torch.randn(37, 48)
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
        weights, ids = ours(x)
        torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
        torch.testing.assert_close(weights, want_weights)
        want = experts(x, want_ids, want_weights)
        got = moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, gelu=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gemma-4-31B", "gemma-4-26B-A4B"])
def test_rotary_tables_of_published_configs_match_transformers(name):
    """Both kinds of layer at the published sizes: the local 256-wide default rotary and the global 512-wide
    proportional one (a quarter of the angles turning, the rest fixed), against Gemma4TextRotaryEmbedding."""
    from pathlib import Path

    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from llmcli.layers.rotary import RotaryEmbedding
    from llmcli.models.gemma4 import Gemma4ForCausalLM
    from llmcli.models.hub import load_hf_config

    config = load_hf_config(Path(__file__).resolve().parent.parent / "configs" / name)
    spec = Gemma4ForCausalLM.spec(config)
    assert (spec.head_dim, spec.global_head_dim, spec.global_k_eq_v) == (256, 512, True)
    theirs = Gemma4TextRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 1000, 8191, 20000])
    for kind, dim, rope in (("sliding_attention", spec.head_dim, spec.local_rope),
                            ("full_attention", spec.global_head_dim, spec.rope)):
        ours = RotaryEmbedding(dim, 20001, rope.theta, rope, spec.max_position_embeddings)
        cos, sin = theirs(torch.zeros(1, len(positions), dim), positions[None], kind)
        torch.testing.assert_close(ours.cos[positions], cos[0], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(ours.sin[positions], sin[0], rtol=1e-5, atol=2e-5)


def test_tensor_parallel_sizes_are_checked_against_the_global_kv_heads_too():
    """Gemma-4-31B's 16 local KV heads split 8 ways, its 4 global ones do not: refused before ranks start."""
    from pathlib import Path

    from llmcli.config import ConfigError
    from llmcli.models.hub import load_hf_config
    from llmcli.parallel.tp_runner import check_tensor_parallel_shapes

    config = load_hf_config(Path(__file__).resolve().parent.parent / "configs" / "gemma-4-31B")
    check_tensor_parallel_shapes(config, 4)
    with pytest.raises(ConfigError, match=r"num_global_key_value_heads=4 is not divisible by 8\..* may be one of "
                                          r"1, 2, 4$"):
        check_tensor_parallel_shapes(config, 8)
