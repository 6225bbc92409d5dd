"""benchmarks/harness/bound.py: the physical bound's terms, floor and table, against numbers worked out by hand."""
from __future__ import annotations

import pytest

from benchmarks.harness.bound import bound_table, physical_bound

# 2 layers, 4 heads of 16, 2 KV heads; 1,000 parameters of which 600 outside the embeddings
FACTS = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "params": 1000, "params_non_embedding": 600}
PROMPTS = [[7, 7], [7, 7, 7]]  # I = 2, 3
OUTS = [4, 1]
CEILINGS = {"copy_bytes_per_s": 1000.0, "matmul_flops_per_s": 100.0}


def test_terms_and_floor_by_hand() -> None:
    b = physical_bound(FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    assert b["decode_steps"] == 4
    assert b["weights_read_bytes"] == 4 * 1000 * 2
    assert b["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K and V, layers, KV heads, head_dim, bytes
    assert b["kv_tokens_read"] == (2 + 3 + 4 + 5) + 3  # request 1 reads 2..5 tokens over 4 steps, request 2 reads 3
    assert b["kv_read_bytes"] == 17 * 256
    assert b["prefill_linear_flops"] == 2 * 600 * 5
    assert b["prefill_attention_flops"] == 4 * 2 * 4 * 16 * (4 + 9) / 2
    assert b["t_weights_s"] == pytest.approx(8.0)
    assert b["t_kv_s"] == pytest.approx(4.352)
    assert b["t_prefill_linear_s"] == pytest.approx(60.0)
    assert b["t_prefill_attention_s"] == pytest.approx(33.28)
    assert b["floor_s"] == pytest.approx(105.632)
    assert b["floor_tok_s"] == pytest.approx(5 / 105.632)


def test_an_untied_input_table_is_gathered_not_read() -> None:
    """Of the 400 parameters outside the layers, an untied model's input table (vocab 50 x hidden 4 = 200) is
    not read by a decode step: each output token gathers its row of 4 values. A tied one is the LM head: read."""
    untied = {**FACTS, "tied_embeddings": False, "vocab": 50, "hidden": 4}
    b = physical_bound(untied, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    assert b["weight_bytes"] == (1000 - 200) * 2 and b["rows_gathered_bytes"] == 5 * 4 * 2
    assert b["weights_read_bytes"] == 4 * 1600 + 40
    assert b["t_weights_s"] == pytest.approx(6.44)
    tied = physical_bound({**untied, "tied_embeddings": True}, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    assert tied["weights_read_bytes"] == 4 * 1000 * 2 and tied["rows_gathered_bytes"] == 0
    moe = physical_bound({**MOE_FACTS, "tied_embeddings": False, "vocab": 50, "hidden": 4}, PROMPTS, OUTS,
                         CEILINGS, elem_bytes=2)
    assert moe["dense_weight_bytes"] == (1000 - 200 - 80) * 2
    assert moe["weights_read_bytes"] == pytest.approx(4 * 1440 + 18 * 20 + 40)


def test_no_times_without_ceilings() -> None:
    b = physical_bound(FACTS, PROMPTS, OUTS, {"copy_bytes_per_s": 1000.0}, elem_bytes=2)
    assert "floor_s" not in b and "t_weights_s" not in b
    assert b["kv_read_bytes"] == 17 * 256


def test_table_sums_the_prefill_terms_into_one_column() -> None:
    b = physical_bound(FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    header, rule, row = bound_table({"w": b}).splitlines()
    assert header == ("| workload | decode steps | weights read | s | KV + state read | s | prefill FLOPs | s | floor s "
                      "| floor tok/s |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0:2] == ["w", "4"]
    assert cells[2:] == ["0.000 TB", "8.000", "0.000 TB", "4.352", "0.0 TFLOP", "93.280", "105.632", "0"]
    assert bound_table({}) is None


def test_decode_steps_with_fewer_slots_than_requests() -> None:
    """20 requests of 3 output tokens at 4 sequences a step need 15 steps, not 3; one long output still sets
    the floor when it is the longer of the two."""
    prompts, outs = [[7]] * 20, [3] * 20
    b = physical_bound(FACTS, prompts, outs, CEILINGS, elem_bytes=2, max_concurrent=4)
    assert b["decode_steps"] == 15  # ceil(60 / 4)
    assert b["weights_read_bytes"] == 15 * 1000 * 2
    assert physical_bound(FACTS, prompts, outs, CEILINGS, elem_bytes=2)["decode_steps"] == 3  # all at once
    assert physical_bound(FACTS, [[7], [7]], [40, 1], CEILINGS, elem_bytes=2, max_concurrent=4)["decode_steps"] == 40


def test_decode_steps_no_fewer_than_the_kv_pool_allows() -> None:
    """No step holds more KV than the pool: the 20 requests' decode steps read 20 x (1 + 2 + 3) = 120 tokens of
    KV at 256 bytes each; a pool of 4 tokens' KV (1,024 bytes) needs ceil(30,720 / 1,024) = 30 steps, though four
    sequences a step would take 15; a pool larger than the whole workload changes nothing."""
    prompts, outs = [[7]] * 20, [3] * 20
    b = physical_bound(FACTS, prompts, outs, CEILINGS, elem_bytes=2, max_concurrent=4, kv_pool_bytes=4 * 256)
    assert b["kv_read_bytes"] == 120 * 256 and b["decode_steps"] == 30
    assert b["weights_read_bytes"] == 30 * 1000 * 2
    big = physical_bound(FACTS, prompts, outs, CEILINGS, elem_bytes=2, max_concurrent=4, kv_pool_bytes=10 ** 9)
    assert big["decode_steps"] == 15


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen3-0.6B", "Llama-3.1-8B", "Llama-3.2-1B", "Qwen2.5-7B",
                                  "Qwen2.5-0.5B", "Mistral-7B-v0.3", "Qwen3-30B-A3B", "Qwen3-235B-A22B",
                                  "Qwen3.5-9B", "Qwen3.6-35B-A3B", "gemma-3-12b-it", "gemma-4-31B", "gemma-4-26B-A4B",
                                  "gpt-oss-20b"])
def test_model_facts_count_what_transformers_builds(name) -> None:
    """The bound's parameter count and shapes for every family's published config (head_dim derived or given,
    biases, tied embeddings) against the transformers model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.harness.workload import REPO, model_facts

    folder = REPO / "configs" / name
    facts = model_facts(folder)
    config = AutoConfig.from_pretrained(str(folder))
    config = getattr(config, "text_config", config)  # a multimodal wrapper: its language model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # tied weights counted once; not counted: gpt-oss's expert biases and sinks, Gemma 4's per-expert scales and
    # extra MoE norms (under 0.05% of the weights, nothing for the bound)
    uncounted = 5e-4 if name in ("gpt-oss-20b", "gemma-4-26B-A4B") else 0
    assert facts["params"] == pytest.approx(sum(p.numel() for p in model.parameters()), rel=uncounted, abs=0)
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    assert facts["linear_layers"] == kinds.count("linear_attention")
    assert facts["sliding_layers"] == kinds.count("sliding_attention")
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    assert facts["head_dim"] == attn.head_dim and facts["kv_heads"] * facts["head_dim"] == attn.k_proj.out_features
    if facts.get("experts"):  # a token multiplies by k of the E experts' weights, and by everything else
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        shared = sum(p.numel() for n, p in model.named_parameters() if ".mlp.shared_expert" in n)
        assert shared == facts["sparse_layers"] * facts.get("shared_params", 0)
        outside = facts["params"] - facts["params_non_embedding"]
        k, e = facts["experts_per_tok"], facts["experts"]
        assert facts["params_active_non_embedding"] == pytest.approx(
            facts["params"] - outside - experts + experts * k // e, rel=uncounted * 10, abs=0)


# the same model with 4 experts of 10 parameters in each of its 2 layers, 2 per token: 80 of its 1,000 parameters
MOE_FACTS = {**FACTS, "experts": 4, "experts_per_tok": 2, "sparse_layers": 2, "expert_params": 10,
             "params_active_non_embedding": 560}


def test_moe_reads_the_dense_weights_and_the_experts_a_batch_touches() -> None:
    """Batches of 2, 1, 1, 1 requests over the 4 decode steps; a token picks 2 of 4 experts, so a batch of B
    touches 4 (1 - 0.5^B) of them per layer: 3, 2, 2, 2."""
    b = physical_bound(MOE_FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    assert b["dense_weight_bytes"] == (1000 - 80) * 2 and b["expert_bytes"] == 20
    assert b["experts_touched"] == pytest.approx(2 * (3 + 2 + 2 + 2))
    assert b["weights_read_bytes"] == pytest.approx(4 * 1840 + 18 * 20)
    assert b["prefill_linear_flops"] == 2 * 560 * 5  # the active parameters only
    assert b["decode_flops_info"] == pytest.approx(2 * 560 * 5 + 4 * 2 * 4 * 16 * 17)
    # one request at a time: 4 steps of the first, then 1 of the second, each a batch of 1
    one = physical_bound(MOE_FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2, max_concurrent=1)
    assert one["weights_read_bytes"] == pytest.approx(5 * 1840 + 2 * 5 * 2 * 20)


def test_fp8_weights_and_kv_by_hand() -> None:
    """FP8 weights: the 600 linear parameters at 1 byte (the 400 embedding ones stay at 2) and the prefill linear
    FLOPs at the FP8 rate; an FP8 KV cache: 1 byte per element. Without the FP8 rate no floor."""
    b = physical_bound(FACTS, PROMPTS, OUTS, {**CEILINGS, "fp8_matmul_flops_per_s": 200.0}, elem_bytes=2,
                       weight_elem_bytes=1, kv_elem_bytes=1)
    assert b["weight_bytes"] == 600 * 1 + 400 * 2
    assert b["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 1
    assert b["prefill_linear_flops"] == 0 and b["prefill_linear_fp8_flops"] == 2 * 600 * 5
    assert b["t_prefill_linear_fp8_s"] == pytest.approx(30.0) and b["t_prefill_linear_s"] == 0
    assert b["floor_s"] == pytest.approx(4 * 1400 / 1000 + 17 * 128 / 1000 + 30.0 + 33.28)
    assert "floor_s" not in physical_bound(FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2, weight_elem_bytes=1)
    assert physical_bound(FACTS, PROMPTS, OUTS, CEILINGS, elem_bytes=2, kv_elem_bytes=1)["floor_s"] == \
        pytest.approx(105.632 - 17 * 128 / 1000)


def test_hybrid_and_sliding_layers_by_hand() -> None:
    """Of 4 layers, 1 full attention, 1 sliding (window 3) and 2 linear ones with 100-byte states: KV per token
    over the 2 attention layers; the sliding one reads min(I + t, 3) tokens a step (2, 3, 3, 3 and 3); each
    output token's step reads and writes both linear layers' states."""
    facts = {**FACTS, "layers": 4, "attention_layers": 2, "sliding_layers": 1, "sliding_window": 3,
             "linear_layers": 2, "linear_state_bytes": 100}
    b = physical_bound(facts, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    per_layer = 2 * 2 * 16 * 2
    assert b["kv_bytes_per_token"] == 2 * per_layer
    assert b["kv_read_bytes"] == (17 + 14) * per_layer
    assert b["state_rw_bytes"] == 2 * 2 * 100 * 5
    assert b["prefill_attention_flops"] == 4 * 2 * 4 * 16 * (4 + 9) / 2
    assert b["floor_s"] == pytest.approx(8.0 + (31 * 128 + 2000) / 1000 + 60.0 + 33.28)


def test_gemma4_layers_of_two_shapes_by_hand() -> None:
    """Gemma 4: of 2 attention layers, the sliding one (window 3) has 2 KV heads of 16, the full one 1 of 32 (and
    its queries 32 wide): each kind's K and V bytes over its own tokens read, each its head size in the attention
    FLOPs. gemma-4-31B's config gives its full layers' shape as facts."""
    from benchmarks.harness.workload import REPO, model_facts

    facts = {**FACTS, "sliding_layers": 1, "sliding_window": 3, "global_kv_heads": 1, "global_head_dim": 32}
    b = physical_bound(facts, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    sliding, full = 2 * 2 * 16 * 2, 2 * 1 * 32 * 2
    assert b["kv_bytes_per_token"] == sliding + full
    assert b["kv_read_bytes"] == 17 * full + 14 * sliding
    assert b["prefill_attention_flops"] == 4 * 4 * (16 + 32) * (4 + 9) / 2
    real = model_facts(REPO / "configs" / "gemma-4-31B")
    assert (real["kv_heads"], real["head_dim"], real["global_kv_heads"], real["global_head_dim"]) == (16, 256, 4, 512)


def test_mxfp4_experts_are_read_at_4_25_bits() -> None:
    """gpt-oss's published configs (MXFP4): each expert weight read as its 4-bit code plus a 32nd of a byte's
    scale; the dense part stays 16-bit."""
    from benchmarks.harness.workload import REPO, model_facts

    facts = model_facts(REPO / "configs" / "gpt-oss-20b")
    assert (facts["experts"], facts["experts_per_tok"], facts["expert_bits"]) == (32, 4, 4.25)
    assert facts["expert_params"] == 3 * 2880 * 2880
    b = physical_bound({**MOE_FACTS, "expert_bits": 4.25}, PROMPTS, OUTS, CEILINGS, elem_bytes=2)
    assert b["dense_weight_bytes"] == (1000 - 80) * 2 and b["expert_bytes"] == pytest.approx(10 * 4.25 / 8)
    assert b["weights_read_bytes"] == pytest.approx(4 * 1840 + 18 * 10 * 4.25 / 8)
