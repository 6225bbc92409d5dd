"""The layer kinds of 2026's models against transformers (fp32 greedy, CPU, tiny random checkpoints written by
transformers): Gemma 3 (local/global layers, two rope bases), Mistral with a sliding window, gpt-oss (sinks,
biased experts, YaRN), Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers with a per-sequence
state in the engine's state pool).

Prompts run several windows long (the tiny windows are 24 keys); chunked prefill with a budget below the
window and below a DeltaNet chunk; preemption, which must recompute a hybrid sequence's state from scratch;
block sizes 16 and 64 (a hybrid model's prefix hits from state snapshots: tests/test_hybrid_prefix_cache.py).
The torch gated delta rule is checked against transformers' own torch fallbacks.
"""
from __future__ import annotations

import os

import json

import pytest
import torch

from test_engine_vs_hf import check_against_hf, greedy, random_prompts, run_factory  # noqa: F401 (a fixture)

NEW_FAMILIES = ("gemma3", "mistral-window", "qwen3.5", "qwen3.5-moe", "qwen3-next", "gpt-oss", "gemma4",
                "gemma4-moe")
LENGTHS = [1, 9, 24, 25, 70, 130]  # around and several times the 24-key window; past a 64-token DeltaNet chunk
MAX_NEW = 16


@pytest.fixture(params=NEW_FAMILIES)
def new_family(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.mark.parametrize("block_size", [16, 64])
def test_long_prompts_at_two_block_sizes(new_family, hf_oracle, run_factory, block_size):
    prompts = random_prompts(LENGTHS, seed=400)
    run = run_factory(new_family, kvcache_block_size=block_size, num_kvcache_blocks=4096 // block_size,
                      max_model_len=256)
    check_against_hf(run, hf_oracle, prompts, max_new=MAX_NEW)


def test_chunked_prefill_and_preemption(new_family, hf_oracle, run_factory):
    """Chunks of 20 tokens (below the window and the DeltaNet chunk) and a pool too small for every sequence
    at once: sequences are preempted and recomputed (a hybrid's state restarts from zero). Window blocks go back
    to the pool as the chunks advance (engine/kv_groups.py)."""
    prompts = random_prompts([50, 75, 99, 120, 8, 64], seed=410)
    # the same memory for every family: Gemma 3's layers are three KV groups of one layer, the dense Gemma 4's three
    # (two local ones, the two half-size global layers side by side in the third), gpt-oss's and the Gemma 4 MoE's
    # two, so their blocks are a third and a half of the others'
    name = new_family.name
    groups = 2 if name.startswith(("tiny_gpt", "tiny_gemma4-moe")) else 3 if name.startswith(("tiny_gemma3",
                                                                                               "tiny_gemma4")) else 1
    blocks = 12 * groups
    run = run_factory(new_family, kvcache_block_size=16, num_kvcache_blocks=blocks, max_model_len=192,
                      max_num_batched_tokens=20)
    check_against_hf(run, hf_oracle, prompts, max_new=40)
    assert run.llm.engine.stats.num_preemptions > 0, "the tiny KV pool should have forced preemption"


def kv_elements_per_token(cfg: dict) -> int:
    """K and V of one token over every layer, each layer its own shape (Gemma 4's global layers: transformers
    writes them as ``per_layer_config``)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shapes = [cfg.get("per_layer_config", {}).get(str(i), {}) for i in range(cfg["num_hidden_layers"])]
    return 2 * sum(s.get("num_key_value_heads", cfg["num_key_value_heads"]) * s.get("head_dim", head_dim)
                   for s in shapes)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "mistral-window", "gemma4"])
def test_window_memory_comes_back_so_more_long_sequences_run_at_once(family, tiny_checkpoint, hf_oracle, run_factory,
                                                                     monkeypatch):
    """The same KV memory and the same prompts (each four windows long): with the blocks that fall out of the
    window going back to the pool, more sequences run at once than with the model's cache laid out as full
    attention (``LLMCLI_KV_WINDOW_RELEASE=0``: one group, nothing released), and both equal transformers."""
    model = tiny_checkpoint(family)
    cfg = json.loads((model / "config.json").read_text())
    full_block = kv_elements_per_token(cfg) * 4 * 16  # fp32, 16 tokens
    memory_gib = 30 * full_block / 2**30  # 30 blocks of full attention: 480 tokens, three of these sequences
    prompts = random_prompts([100] * 8, seed=430)
    peak, blocks = {}, {}
    for release in ("0", "1"):
        monkeypatch.setenv("LLMCLI_KV_WINDOW_RELEASE", release)
        run = run_factory(model, kvcache_block_size=16, num_kvcache_blocks=None, kv_cache_memory_gib=memory_gib,
                          max_model_len=192, max_num_batched_tokens=64)
        check_against_hf(run, hf_oracle, prompts, max_new=40)
        peak[release] = run.llm.engine.stats.peak_running
        report = run.llm.engine.model_runner.memory_report
        blocks[release] = (report.num_blocks, [g["window"] for g in report.kv_groups])
    assert blocks["0"] == (30, [None])
    # Mistral's every layer is windowed: a sequence holds ~3 blocks instead of 9. Gemma 3's global layer keeps
    # all 9 (of a third of the size) beside two local layers' ~3 each: (3 x 9) / (9 + 2 x 3) = 1.8x at most; so
    # does the dense Gemma 4, its two half-size global layers in one group beside its two local layers' groups
    gain = 2.0 if family == "mistral-window" else 1.5
    assert peak["1"] >= gain * peak["0"], (peak, blocks)


@pytest.mark.parametrize("family", ["gemma3", "mistral-window", "gemma4"])
def test_prefix_hits_deeper_than_the_window(family, tiny_checkpoint, hf_oracle, run_factory):
    """A 100-token shared prefix (four windows) computed in chunks, its early window blocks given back on the
    way: later prompts sharing it hit 96 tokens (the window group needs only the blocks its first query reads)
    and still equal transformers."""
    model = tiny_checkpoint(family)
    shared = random_prompts([100], seed=440)[0]
    prompts = [shared + tail for tail in random_prompts([5, 17, 30], seed=441)]
    run = run_factory(model, kvcache_block_size=16, max_num_batched_tokens=32)
    check_against_hf(run, hf_oracle, prompts[:1], max_new=8)
    before = run.llm.engine.stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts, max_new=8)
    assert run.llm.engine.stats.prefix_cache_hit_tokens - before >= 3 * 96


def test_gemma3_and_mistral_need_no_max_model_len_cap(tiny_checkpoint):
    """A sliding window no longer forces max_model_len down to it (it was refused before)."""
    from transformers import AutoConfig

    from llmcli.models import check_model_config

    for family in ("gemma3", "mistral-window", "gpt-oss"):
        check_model_config(AutoConfig.from_pretrained(tiny_checkpoint(family)), 4096)


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32] uint8, the values they hold):
    a power-of-two scale per 32 values putting the largest at or under 6, each value rounded to e2m1."""
    e, o, i = x.shape
    groups = x.float().reshape(e, o, i // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    idx = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    values = (E2M1_MAGNITUDES[idx] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exp)[..., None]).reshape(e, o, i)
    codes = (idx + 8 * (scaled < 0)).to(torch.uint8).reshape(e, o, i // 32, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8), values


def write_mxfp4_twins(base, where):
    """``(packed, plain)``: copies of the 16-bit gpt-oss checkpoint ``base``, one with its experts as MXFP4 blocks
    and e8m0 scales (quantization_config as published), one 16-bit holding the very values the blocks encode."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    packed, plain = (shutil.copytree(base, where / n) for n in ("mxfp4", "dequantized"))
    state = load_file(str(base / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] in the 16-bit form
            blocks, scales, values = to_mxfp4(t.transpose(1, 2))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = values.transpose(1, 2).contiguous()
        else:
            quantized[name] = dequantized[name] = t
    assert sum(n.endswith("_blocks") for n in quantized) == 4  # two layers' gate_up and down
    save_file(quantized, str(packed / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                  "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(cfg))
    return packed, plain


def test_gpt_oss_mxfp4_experts_equal_the_same_model_dequantized(tiny_checkpoint, tmp_path, hf_oracle, run_factory):
    """An MXFP4 checkpoint (its experts as blocks and e8m0 scales, the rest 16-bit) dequantized at load gives
    transformers' greedy tokens on the 16-bit checkpoint holding the very values the blocks encode (the CPU path;
    ``tests/test_triton_moe_mxfp4.py`` runs the same checkpoint with its experts kept in MXFP4)."""
    base = tiny_checkpoint("gpt-oss")
    packed, plain = write_mxfp4_twins(base, tmp_path)
    prompts = random_prompts([9, 40, 70], seed=430)
    want = hf_oracle.greedy(plain, prompts, MAX_NEW)
    assert want != hf_oracle.greedy(base, prompts, MAX_NEW), "rounding to MXFP4 should change the tokens"
    run = run_factory(packed, kvcache_block_size=16, max_model_len=256)
    got = [o["token_ids"] for o in run.llm.generate(prompts, greedy(MAX_NEW))]
    assert got == want


def test_gpt_oss_mxfp4_split_through_a_scale_group_is_refused_in_one_line(tiny_checkpoint, tmp_path):
    """On CUDA the experts stay in MXFP4 and tensor parallelism cuts whole 32-value groups: the tiny model's
    intermediate size 32 is one group, which 2 ranks would split (refused before anything loads); on the CPU,
    which dequantizes at load, the same split is fine."""
    import json
    import shutil

    from transformers import AutoConfig

    from llmcli.config import Config, ConfigError

    model = shutil.copytree(tiny_checkpoint("gpt-oss"), tmp_path / "mxfp4")
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (model / "config.json").write_text(json.dumps(cfg))
    config = object.__new__(Config)  # the check alone: this machine may have no CUDA to ask Config for
    config.model_path, config.quantization, config.load_format = model, None, "auto"
    config.hf_config, config.tensor_parallel_size = AutoConfig.from_pretrained(model), 2
    config.device = "cpu"
    assert config._resolve_quantization().source == "mxfp4"
    config.device = "cuda"
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: .*intermediate_size 32 over 2 ranks would "
                                          r"split the MXFP4 experts' 32-value scale groups") as info:
        config._resolve_quantization()
    assert "\n" not in str(info.value)
    config.tensor_parallel_size = 1
    assert config._resolve_quantization().source == "mxfp4"


# published sizes (configs/): the text model llmcli builds has the parameter count the model card gives
PUBLISHED = {"Qwen3.5-9B": 8.95e9, "Qwen3.6-27B": 26.9e9, "Qwen3.6-35B-A3B": 34.7e9, "gemma-3-12b-it": 11.77e9,
             "gemma-3-27b-it": 27.0e9, "Mistral-7B-v0.1": 7.24e9, "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9,
             "gemma-4-31B": 30.7e9, "gemma-4-26B-A4B": 25.2e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_build_the_published_sizes(name):
    from pathlib import Path

    from llmcli.kernels.torch_backend import TorchAttentionBackend
    from llmcli.models import check_model_config, model_class
    from llmcli.models.hub import load_hf_config

    config = load_hf_config(Path(__file__).resolve().parent.parent / "configs" / name)
    check_model_config(config, 32768)
    with torch.device("meta"):
        model = model_class(config)(config, TorchAttentionBackend(1, 1, 1, 1.0, 16), 32768)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / PUBLISHED[name] - 1) < 0.01, f"{name}: {count / 1e9:.2f}B parameters"


# --------------------------------------------------------------------------
# the kernels against transformers' torch fallbacks
# --------------------------------------------------------------------------
def _inputs(length: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(length, hv, dv, generator=g)
    decay = -torch.rand(length, hv, generator=g) * 0.5
    beta = torch.rand(length, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_gated_delta_rule_matches_transformers(length, with_state):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from llmcli.kernels.gated_delta_torch import gated_delta_rule_chunked

    q, k, v, decay, beta, state = _inputs(length)
    init = state if with_state else None
    want, want_state = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=decay[None], beta=beta[None], initial_state=None if init is None else init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = gated_delta_rule_chunked(q, k, v, decay, beta, init, chunk=32)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, want_state[0], rtol=1e-4, atol=1e-5)


def test_recurrent_step_and_chunks_continue_each_other():
    """Prefill in two chunks, then decode token by token from the carried state = transformers' recurrent form
    over the whole sequence; the conv1d with a carried state = one convolution over the whole sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    from llmcli.kernels.gated_delta_torch import (causal_conv1d, causal_conv1d_step, gated_delta_rule_chunked,
                                                  gated_delta_rule_step)

    q, k, v, decay, beta, _ = _inputs(40, seed=1)
    want, want_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=decay[None], beta=beta[None],
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    a, s = gated_delta_rule_chunked(q[:17], k[:17], v[:17], decay[:17], beta[:17], None, chunk=8)
    b, s = gated_delta_rule_chunked(q[17:30], k[17:30], v[17:30], decay[17:30], beta[17:30], s, chunk=8)
    outs = [a, b]
    for t in range(30, 40):
        o, s = gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s[None])
        outs.append(o)
        s = s[0]
    torch.testing.assert_close(torch.cat(outs), want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, want_state[0], rtol=1e-4, atol=1e-5)

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    whole = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], w[:, None], padding=3, groups=12)[0, :, :30]).t()
    first, state = causal_conv1d(x[:11], w, None)
    second, state = causal_conv1d(x[11:29], w, state)
    last, _ = causal_conv1d_step(x[29:], w, state[None])
    torch.testing.assert_close(torch.cat([first, second, last]), whole, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# multimodal checkpoints, language model only
# --------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3.5-vl", "gemma3-vl", "gemma4-vl"])
def test_multimodal_checkpoint_runs_its_language_model(family, tiny_checkpoint, hf_oracle, run_factory, monkeypatch,
                                                       caplog):
    """A Qwen3.5 / Gemma 3 checkpoint with its vision tower: the text decoder gives transformers' tokens, the
    vision tensors are never read, and start-up says so once."""
    import llmcli.models.loader as loader

    model = tiny_checkpoint(family)
    read: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    with caplog.at_level("WARNING", logger="llmcli"):
        run = run_factory(model, kvcache_block_size=16, max_model_len=256)
    check_against_hf(run, hf_oracle, random_prompts([3, 40, 90], seed=430), max_new=MAX_NEW)
    assert read and not [n for n in read if "vis" in n or "multi_modal" in n], read
    assert any(n.startswith(("model.language_model.", "language_model.")) for n in read)
    told = [r.getMessage() for r in caplog.records if "language model only" in r.getMessage()]
    assert len(told) == 1, told  # each checkpoint is written for this test only: its first start-up says it


# --------------------------------------------------------------------------
# tensor parallelism: linear-attention heads (and the shared expert) split over 2 CPU ranks
# --------------------------------------------------------------------------
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")
@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next", "gemma3", "gemma4-moe"])  # (the tiny Mistral has one KV head)
def test_tp2_matches_transformers(family, tiny_checkpoint, hf_oracle):
    """Qwen3.5's separate and Qwen3-Next's per-key-head fused projections reach each rank's heads; the
    state pool holds each rank's heads; Gemma 3's two rotaries and window per rank, and its KV groups' tables
    (window blocks given back in 40-token chunks) on every rank."""
    from llmcli import LLM

    from test_engine_vs_hf import assert_same_tokens, greedy

    model = tiny_checkpoint(family)
    prompts = random_prompts([1, 30, 90], seed=440)
    llm = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2, kvcache_block_size=16,
              num_kvcache_blocks=64, max_num_batched_tokens=40, max_num_seqs=8, max_model_len=256,
              enforce_eager=True)
    try:
        outs = llm.generate(prompts, greedy(MAX_NEW))
    finally:
        llm.shutdown()
    want = hf_oracle.greedy(model, prompts, MAX_NEW)
    assert_same_tokens(hf_oracle, model, prompts, outs, want, f"TP=2 {family}")


def test_hybrid_memory_report_counts_the_state_pool_and_attention_layers_only(tiny_checkpoint, run_factory):
    """The probe's numbers from config.json's sizes: KV per token over the full-attention layers alone, and a
    sequence's states (conv state in the model dtype, a float32 recurrent state per linear layer, each started on
    256 bytes) in whole KV blocks; with num_kvcache_blocks set, the pool is that many KV blocks beside
    (max_num_seqs + 1) sequence rows, the prefix cache's snapshot rows (4 by default at 6 sequences) and a scratch
    row for graph padding rows."""
    import json

    cfg = json.loads((tiny_checkpoint("qwen3.5") / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    run = run_factory(tiny_checkpoint("qwen3.5"), kvcache_block_size=16, max_num_seqs=6)
    report = run.llm.engine.model_runner.memory_report
    kinds = cfg["layer_types"]
    full, linear = kinds.count("full_attention"), kinds.count("linear_attention")
    itemsize = 4  # the oracle runs fp32
    assert report.kv_bytes_per_token == 2 * full * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    key, value = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], \
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    conv = (2 * key + value) * (cfg["linear_conv_kernel_dim"] - 1) * itemsize
    ssm = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
    aligned = lambda n: -(-n // 256) * 256  # noqa: E731
    assert report.state_row_bytes == linear * (aligned(conv) + aligned(ssm))
    row_pages = -(-report.state_row_bytes // (16 * report.kv_bytes_per_token))
    assert report.state_pages.row_pages == row_pages
    assert report.num_blocks == 1024 + (6 + 1 + 4 + 1) * row_pages
    assert report.state_pool_bytes == (6 + 1 + 4 + 1) * row_pages * report.kv_bytes_per_block
    assert report.num_state_snapshots == 4
    assert report.state_snapshot_bytes == 4 * row_pages * report.kv_bytes_per_block


@pytest.mark.parametrize("tensor,damage", [
    ("A_log", lambda t: t[:1].contiguous()),
    ("conv1d.weight", lambda t: t[:, :, :2].contiguous()),
    ("in_proj_qkv.weight", lambda t: t[:-16].contiguous()),
    ("in_proj_b.weight", lambda t: torch.cat([t, t])),
])
def test_mis_shaped_linear_attention_tensor_is_refused_naming_it(tiny_checkpoint, tmp_path, tensor, damage):
    from test_model_checks import _copy, _edit_tensors, _llm, _replace

    from llmcli.models.loader import CheckpointError

    name = f"model.layers.0.linear_attn.{tensor}"
    folder = _edit_tensors(_copy(tiny_checkpoint("qwen3.5"), tmp_path), _replace(name, damage))
    with pytest.raises(CheckpointError, match=rf"size mismatch for {name.replace('.', '[.]')}: shape .* the model "
                                              r"expects \("):
        _llm(folder)


def test_gemma3_activation_is_checked_under_its_own_field(tiny_checkpoint, tmp_path):
    from test_model_checks import _copy, _edit_config, _llm

    from llmcli.models.config_checks import ModelConfigError

    folder = _copy(tiny_checkpoint("gemma3"), tmp_path)
    _edit_config(folder, lambda cfg: cfg.update(hidden_activation="relu"))
    with pytest.raises(ModelConfigError, match=r"hidden_activation='relu' is not what this model runs; .*"
                                               r"gelu_pytorch_tanh"):
        _llm(folder)
