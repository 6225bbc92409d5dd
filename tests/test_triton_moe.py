"""The fused MoE kernel (kernels/triton_moe.py) against the reference loop over experts (kernels/moe_reference.py).

Without CUDA the kernels run under Triton's interpreter in float32 and float16 (its bfloat16 dot is wrong);
with CUDA in bfloat16 too, at Qwen3-30B-A3B's and Gemma-4-26B-A4B's expert shapes, and captured in a CUDA graph.
The activation switches (GeGLU, gpt-oss's biases and clamped SwiGLU) are checked together, and gpt-oss's block
against transformers' GptOssMLP (Gemma 4's router and experts: tests/test_gemma4.py).
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "llmcli.kernels.triton_moe" in sys.modules:  # triton fixes interpreted vs compiled at decoration
        importlib.reload(sys.modules["llmcli.kernels.triton_moe"])

from llmcli.kernels.moe_reference import moe_reference, route  # noqa: E402
from llmcli.kernels.triton_moe import MoeTuning, align_by_expert, fused_moe  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5 if not ON_GPU else 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, skew: float = 0.0, seed=0):
    """Random activations and experts; ``skew`` > 0 pushes the router towards the first few experts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=g) - skew * torch.arange(experts)
    return x, w13, w2, logits.to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 3, 17, 40])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_reference(tokens, experts, top_k, dtype):
    """Token counts of 1 and off the 16-row tile, top-2 of 8 and top-8 of 16, normalised weights; odd sizes
    (48 hidden, 40 intermediate) leave partial column and K tiles."""
    x, w13, w2, logits = make_case(tokens, experts, top_k, 48, 40, dtype, seed=tokens)
    weights, ids = route(logits, top_k, normalize=True)
    got = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_experts_without_tokens_and_every_tile_size(block_m):
    """A skewed router leaves most experts idle (no tiles for them); unnormalised weights; larger row tiles."""
    x, w13, w2, logits = make_case(45, 12, 2, 32, 32, torch.float32, skew=3.0, seed=block_m)
    weights, ids = route(logits, 2, normalize=False)
    assert len(ids.unique()) < 12, "the skewed router should leave some experts without tokens"
    got = fused_moe(x, w13, w2, weights, ids, MoeTuning(block_m=block_m, block_n=32, block_k=32))
    ref = moe_reference(x, w13, w2, weights, ids)
    assert rel_err(got, ref) < TOL[torch.float32]


def test_align_groups_pairs_by_expert_in_padded_runs():
    """Every (token, slot) pair once, each tile of one expert, runs padded with the sentinel, within capacity."""
    torch.manual_seed(0)
    tokens, top_k, experts, block_m = 29, 4, 10, 16
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    ids[ids == 3] = 4  # expert 3 gets nothing (top-k ids of a token may then repeat: fine for the grouping)
    pairs, tile_expert, total = align_by_expert(ids, experts, block_m)
    n = tokens * top_k
    assert pairs.numel() == -(-(n + experts * (block_m - 1)) // block_m) * block_m
    pairs, tile_expert, total = pairs.cpu(), tile_expert.cpu(), int(total)
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (pairs[total:] == n).all() and (tile_expert[total // block_m:] == -1).all()
    flat = ids.flatten().cpu()
    for tile in range(total // block_m):
        members = pairs[tile * block_m:(tile + 1) * block_m]
        members = members[members < n]
        assert len(members) > 0 and (flat[members] == tile_expert[tile]).all()
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert 3 not in tile_expert.tolist()


# the experts' activation switches, as fused_moe and moe_reference both take them: SwiGLU (Qwen), GeGLU (Gemma 4),
# gpt-oss's clamped SwiGLU (alpha 1.702, limit 7)
ACTIVATIONS = {"swiglu": {}, "geglu": {"gelu": True}, "clamped": {"clamp": (1.702, 7.0)}}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_switches_compose(act, bias, dtype):
    """Each activation with and without biases on both projections (gpt-oss's; they go with GeGLU too) against the
    loop, 17 tokens through top-2 of 8 at odd sizes (partial tiles); in float32, turning any one switch off
    changes the result, so none is ignored. The clamped case's weights are scaled so many values pass the limit."""
    x, w13, w2, logits = make_case(17, 8, 2, 48, 40, dtype, seed=117)
    weights, ids = route(logits, 2, normalize=True)
    switches = dict(ACTIVATIONS[act])
    if act == "clamped":
        w13 = w13 * 10
        assert (torch.nn.functional.linear(x.float(), w13[0].float()).abs() > 7).float().mean() > 0.1
    if bias:
        g = torch.Generator(device="cpu").manual_seed(17)
        switches.update(b13=torch.randn(8, 80, generator=g).to(DEVICE, dtype),
                        b2=torch.randn(8, 48, generator=g).to(DEVICE, dtype))
    as_float = {k: v.float() if torch.is_tensor(v) else v for k, v in switches.items()}
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids, **as_float)
    assert rel_err(fused_moe(x, w13, w2, weights, ids, **switches), ref) < TOL[dtype]
    if dtype == torch.float32:
        for off in switches:
            fewer = {k: v for k, v in switches.items() if k != off}
            assert rel_err(fused_moe(x, w13, w2, weights, ids, **fewer), ref) > 10 * TOL[dtype], off


def test_geglu_and_the_clamp_are_refused_together():
    """The clamp is a SwiGLU's: asking for it with GeGLU is one clear error in both paths, not a silent pick."""
    x, w13, w2, logits = make_case(3, 8, 2, 48, 40, torch.float32)
    weights, ids = route(logits, 2, normalize=True)
    for path in (fused_moe, moe_reference):
        with pytest.raises(ValueError, match=r"clamped SwiGLU .* and GeGLU .* are two activations: pass one"):
            path(x, w13, w2, weights, ids, gelu=True, clamp=(1.702, 7.0))


gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1000, 4096])
def test_bf16_at_qwen3_30b_a3b_shapes(tokens):
    """128 experts, top-8, hidden 2048, intermediate 768 (one rank's full expert), bf16 against a float32 loop;
    run twice, the same bits (the grouping's atomics place pairs in another order, the rows do not care)."""
    x, w13, w2, logits = make_case(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens)
    weights, ids = route(logits, 8, normalize=True)
    got = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), got)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_bf16_gelu_at_gemma4_26b_a4b_shapes(tokens):
    """128 experts, top-8, hidden 2816, expert intermediate 704, tanh-GELU, bf16 against a float32 loop."""
    x, w13, w2, logits = make_case(tokens, 128, 8, 2816, 704, torch.bfloat16, seed=tokens)
    weights, ids = route(logits, 8, normalize=True)
    got = fused_moe(x, w13, w2, weights, ids, gelu=True)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids, gelu=True)
    assert rel_err(got, ref) < TOL[torch.bfloat16]


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_captured_in_a_cuda_graph():
    """Routing, grouping and both GEMMs replay from a graph with new routing each time (no host sync inside)."""
    x, w13, w2, logits = make_case(48, 64, 8, 256, 128, torch.bfloat16)
    weights, ids = route(logits, 8, normalize=True)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in range(3):
        _, _, _, fresh = make_case(48, 64, 8, 256, 128, torch.bfloat16, seed=100 + seed)
        new_w, new_ids = route(fresh, 8, normalize=True)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        ref = moe_reference(x.float(), w13.float(), w2.float(), new_w, new_ids)
        assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_moe_layer_runs_either_backend(monkeypatch):
    """layers/moe.py's block gives the same output through the fused kernel (LLMCLI_MOE=triton: interpreted on
    the CPU) as through the loop (LLMCLI_MOE=reference): its stacked weights are laid out as both expect."""
    from llmcli.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(hidden_size=32, intermediate_size=24, num_experts=8, top_k=2, normalize=True).to(DEVICE)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(19, 32, device=DEVICE)
    monkeypatch.setenv("LLMCLI_MOE", "reference")
    ref = block(x)
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    assert rel_err(block(x), ref) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gpt_oss_block_matches_transformers_mlp(backend, monkeypatch):
    """``layers/moe.GptOssMoeBlock`` loaded from transformers' ``GptOssMLP`` (its interleaved gate/up tensor and
    biases through the block's loaders) gives the same output, through the loop and through the fused kernel."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from llmcli.layers.moe import GptOssMoeBlock

    monkeypatch.setenv("LLMCLI_MOE", backend)
    config = GptOssConfig(hidden_size=48, intermediate_size=40, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    theirs = GptOssMLP(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.5)
    ours = GptOssMoeBlock(48, 40, 8, 2, config.swiglu_alpha, config.swiglu_limit)
    state = theirs.state_dict()
    ours.router.weight.data.copy_(state["router.weight"])
    ours.router.bias.data.copy_(state["router.bias"])
    e = ours.experts
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias"):
        getattr(e, name).weight_loader(getattr(e, name), state[f"experts.{name}"])
    e.down_proj_bias.data.copy_(state["experts.down_proj_bias"])
    x = torch.randn(1, 23, 48)
    with torch.no_grad():
        want = theirs(x)[0][0]
        got = ours.to(DEVICE)(x[0].to(DEVICE))
    assert rel_err(got.cpu(), want) < 1e-5
