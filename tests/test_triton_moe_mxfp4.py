"""The MXFP4 fused MoE (kernels/triton_moe_mxfp4.py) against dequantize-then-matmul, and gpt-oss's block with its
experts kept in MXFP4 (layers/moe_mxfp4.py) against the same block holding the dequantized values.

Without CUDA the kernels run under Triton's interpreter in float32 and float16 (its bfloat16 dot is wrong); with
CUDA in bfloat16 too, at gpt-oss-20b's expert shapes, and captured in a CUDA graph. 16-bit activations run both
tile products (``tl.dot_scaled`` and the in-register dequantization), float32 the second, its only one. The sm_90
compile check builds the kernels for an H200 with no GPU. Their speed: ``tests/test_gpu_moe_mxfp4_speed.py``.
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
    for _name in ("llmcli.kernels.triton_moe", "llmcli.kernels.triton_moe_mxfp4",
                  "llmcli.kernels.triton_moe_mxfp4_frag"):
        if _name in sys.modules:  # triton fixes interpreted vs compiled at decoration
            importlib.reload(sys.modules[_name])

from llmcli.kernels.moe_reference import moe_reference, route  # noqa: E402
from llmcli.kernels.triton_moe import MoeTuning  # noqa: E402
from llmcli.kernels.triton_moe_mxfp4 import KERNELS, fused_moe_mxfp4, mxfp4_kernel  # noqa: E402
from test_engine_vs_hf import greedy, random_prompts, run_factory  # noqa: E402, F401 (a fixture)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5 if not ON_GPU else 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (dtype, kernel): every tile product each activation dtype runs
PATHS = [pytest.param(d, k, id=f"{str(d)[6:]}-{k}") for d in DTYPES for k in KERNELS
         if mxfp4_kernel(d, k, DEVICE) == k]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def values_of(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The oracle's float32 weights [E, N, K] of codes [E, N, K/2] and scales [E, N, K/32], written out here (a
    table lookup per nibble, low nibble first, times 2^(scale - 127)) rather than taken from the code under test."""
    codes, scales = codes.long(), scales.double()  # on the codes' device (the GPU tests' shapes are large)
    nibbles = torch.stack([codes % 16, codes // 16], dim=-1).flatten(-2)
    table = E2M1.to(codes.device, torch.float64)
    per_group = table[nibbles].unflatten(-1, (-1, 32)) * (2.0 ** (scales - 127))[..., None]
    return per_group.flatten(-2).float()


def random_mxfp4(experts: int, rows: int, cols: int, g: torch.Generator, scales: tuple[int, int] = (118, 124)):
    """Random codes (every e2m1 value, both zeros) and scales around 2^-5: [E, rows, cols/2] and [E, rows, cols/32]."""
    codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(*scales, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return codes.to(DEVICE), exps.to(DEVICE)


def make_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int = 0, skew: float = 0.0,
              gate_up_scales: tuple[int, int] = (118, 124)):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13 = random_mxfp4(experts, 2 * inter, hidden, g, gate_up_scales)
    w2 = random_mxfp4(experts, hidden, inter, g)
    logits = torch.randn(tokens, experts, generator=g) - skew * torch.arange(experts)
    return x, w13, w2, logits.to(DEVICE)


def reference(x, w13, w2, weights, ids, **kw):
    return moe_reference(x.float().cpu(), values_of(*w13).cpu(), values_of(*w2).cpu(), weights.cpu(), ids.cpu(),
                         **kw).to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 17, 40])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4), (4, 4)])
@pytest.mark.parametrize("dtype,kernel", PATHS)
def test_mxfp4_moe_matches_dequantize_then_matmul(tokens, experts, top_k, dtype, kernel):
    """Token counts of 1 and off the row tile, top-2 of 8, top-4 of 16, every expert for every token (16- and
    64-row tiles); hidden 96 and intermediate 160 leave partial K tiles (of 128 and 64 values) and partial column
    tiles."""
    x, w13, w2, logits = make_case(tokens, experts, top_k, 96, 160, dtype, seed=tokens + experts)
    weights, ids = route(logits, top_k, normalize=True)
    got = fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel=kernel)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got, reference(x, w13, w2, weights, ids)) < TOL[dtype]


@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("dtype,kernel", PATHS)
def test_mxfp4_moe_with_biases_and_the_clamped_swiglu(tokens, dtype, kernel):
    """gpt-oss's experts: both biases and the clamped SwiGLU (alpha 1.702, limit 7; large gate/up scales so that
    many values pass the limit); without the switches the result differs."""
    x, w13, w2, logits = make_case(tokens, 8, 2, 64, 96, dtype, seed=200 + tokens, gate_up_scales=(125, 128))
    g = torch.Generator(device="cpu").manual_seed(tokens)
    b13 = torch.randn(8, 192, generator=g).to(DEVICE, dtype)
    b2 = torch.randn(8, 64, generator=g).to(DEVICE, dtype)
    weights, ids = route(logits, 2, normalize=True)
    ref = reference(x, w13, w2, weights, ids, clamp=(1.702, 7.0), b13=b13.float().cpu(),
                    b2=b2.float().cpu())
    h = torch.nn.functional.linear(x.float().cpu(), values_of(*w13)[0].cpu(), b13[0].float().cpu())
    assert (h.abs() > 7).float().mean() > 0.1, "the case should exercise the clamp"
    got = fused_moe_mxfp4(x, *w13, *w2, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0), kernel=kernel)
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel=kernel), ref) > 10 * TOL[dtype]


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("dtype,kernel", PATHS)
def test_mxfp4_experts_without_tokens_and_other_tiles(block_m, dtype, kernel):
    """A skewed router leaves experts idle; unnormalised weights; 64-deep K tiles (two scale groups each, the
    scales loaded a tile ahead over a K of one tile)."""
    x, w13, w2, logits = make_case(45, 12, 2, 64, 64, dtype, seed=block_m, skew=3.0)
    weights, ids = route(logits, 2, normalize=False)
    assert len(ids.unique()) < 12
    tuning = MoeTuning(block_m=block_m, block_n=64 if kernel == "frag" else 32, block_k=64)  # frag: a warpgroup
    got = fused_moe_mxfp4(x, *w13, *w2, weights, ids, tuning, kernel=kernel)
    assert rel_err(got, reference(x, w13, w2, weights, ids)) < TOL[dtype]


def test_the_tile_product_is_chosen_per_dtype_and_by_the_environment(monkeypatch):
    """``scaled`` by default for 16-bit activations (faster than bf16 on an H200), ``LLMCLI_MXFP4_KERNEL`` or the
    argument;
    float32 always ``dequant`` (``tl.dot_scaled`` takes 16-bit and 8/4-bit operands only); anything else refused
    by name."""
    monkeypatch.delenv("LLMCLI_MXFP4_KERNEL", raising=False)
    assert [mxfp4_kernel(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == ["scaled", "scaled", "dequant"]
    monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "dequant")
    assert mxfp4_kernel(torch.bfloat16) == "dequant" and mxfp4_kernel(torch.bfloat16, "scaled") == "scaled"
    assert mxfp4_kernel(torch.float32, "scaled") == "dequant"
    # frag: Hopper with bfloat16 on a GPU; Triton's interpreter emulates it at any dtype
    cpu = torch.device("cpu")
    assert [mxfp4_kernel(d, "frag", cpu) for d in (torch.float32, torch.float16)] == ["frag", "frag"]
    assert [mxfp4_kernel(d, "frag") for d in (torch.float16, torch.float32)] == ["scaled", "dequant"]
    monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "fast")
    with pytest.raises(ValueError, match="MXFP4 kernel 'fast': one of scaled, dequant, frag$"):
        mxfp4_kernel(torch.bfloat16)


def test_mxfp4_moe_refuses_a_k_off_the_groups():
    x, w13, w2, logits = make_case(3, 4, 2, 64, 64, torch.float32)
    weights, ids = route(logits, 2, normalize=True)
    with pytest.raises(ValueError, match=r"down experts: MXFP4 codes \[E, N, K/2\] and scales"):
        fused_moe_mxfp4(x, *w13, w2[0][..., :24], w2[1][..., :1], weights, ids)


# -- gpt-oss's block ---------------------------------------------------------------------------------------------------

def checkpoint_experts(experts: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    """A gpt-oss layer's expert tensors as the MXFP4 checkpoint stores them (gate/up rows interleaved)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    state = {}
    for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        codes, scales = (t.cpu() for t in random_mxfp4(experts, rows, cols, g, (120, 126)))
        state[name + "_blocks"], state[name + "_scales"] = codes.unflatten(2, (cols // 32, 16)), scales
    state["gate_up_proj_bias"] = torch.randn(experts, 2 * inter, generator=g)
    state["down_proj_bias"] = torch.randn(experts, hidden, generator=g)
    return state


def gpt_oss_blocks(state, hidden, inter, experts, top_k, rank=0, world=1):
    """(packed block of rank ``rank`` of ``world``, the 16-bit block holding the values its blocks encode)."""
    from llmcli.layers import moe
    from llmcli.layers.quantization.mxfp4 import dequantize_mxfp4

    made = []
    for packed in (True, False):
        mp = pytest.MonkeyPatch()
        mp.setattr(moe, "tp_rank", lambda: rank if packed else 0)
        mp.setattr(moe, "tp_size", lambda: world if packed else 1)
        try:
            block = moe.GptOssMoeBlock(hidden, inter, experts, top_k, 1.702, 7.0, mxfp4=packed)
        finally:
            mp.undo()
        g = torch.Generator(device="cpu").manual_seed(7)
        block.router.weight.data.copy_(torch.randn(experts, hidden, generator=g) * 0.3)
        block.router.bias.data.copy_(torch.randn(experts, generator=g))
        e = block.experts
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = state[name + "_blocks"], state[name + "_scales"]
            if packed:
                getattr(e, name + "_blocks").weight_loader(getattr(e, name + "_blocks"), blocks)
                getattr(e, name + "_scales").weight_loader(getattr(e, name + "_scales"), scales)
            else:  # the checkpoint's 16-bit form: [E, in, out]
                getattr(e, name).weight_loader(getattr(e, name), dequantize_mxfp4(blocks, scales))
        e.gate_up_proj_bias.weight_loader(e.gate_up_proj_bias, state["gate_up_proj_bias"])
        e.down_proj_bias.data.copy_(state["down_proj_bias"])
        made.append(block.to(DEVICE))
    return made


@pytest.mark.parametrize("tokens", [1, 23])
def test_gpt_oss_block_in_mxfp4_equals_the_dequantized_block(tokens, monkeypatch):
    """The block with packed experts through the MXFP4 kernel gives what the block loaded with the dequantized
    16-bit tensors gives through the loop (and through the 16-bit fused kernel): the packed loaders de-interleave
    gate and up rows and keep their scales with them."""
    state = checkpoint_experts(8, 64, 96, seed=tokens)
    packed, plain = gpt_oss_blocks(state, 64, 96, 8, 2)
    assert packed.experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not any(p.dtype == torch.uint8 for p in plain.parameters())
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    monkeypatch.setenv("LLMCLI_MOE", "reference")
    want = plain(x)
    assert rel_err(packed(x), want) < 1e-5  # the packed block's own reference path (dequantized on the fly)
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    assert rel_err(plain(x), want) < TOL[torch.float32]
    assert rel_err(packed(x), want) < TOL[torch.float32]


def test_two_ranks_of_mxfp4_experts_sum_to_the_whole(monkeypatch):
    """Tensor parallelism over 2 ranks: each keeps whole 32-value groups of the intermediate dimension (gate and
    up rows of the same columns, down's matching scale groups); their partial outputs sum to the whole block's
    (the down bias on rank 0 only)."""
    state = checkpoint_experts(8, 64, 128, seed=3)
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    whole = gpt_oss_blocks(state, 64, 128, 8, 2)[1](x)
    parts = [gpt_oss_blocks(state, 64, 128, 8, 2, rank=r, world=2)[0] for r in (0, 1)]
    assert parts[0].experts.down_proj_blocks.shape == (8, 64, 32)  # [E, H, 64 of 128 columns / 2]
    assert parts[1].tp_rank == 1
    assert not torch.equal(parts[0].experts.down_proj_scales, parts[1].experts.down_proj_scales)
    # one process: the block's all-reduce is the identity, so each output is that rank's partial sum
    assert rel_err(parts[0](x) + parts[1](x), whole) < TOL[torch.float32]


def test_a_split_through_a_scale_group_is_refused_in_one_line():
    """gpt-oss's intermediate size 2880 is 90 groups: 2 ranks take 45 each, 4 would cut groups in half."""
    from llmcli.layers.moe_mxfp4 import Mxfp4Experts, check_mxfp4_split

    assert check_mxfp4_split(2880, 1) is None and check_mxfp4_split(2880, 2) is None
    why = check_mxfp4_split(2880, 4)
    assert "intermediate_size 2880 over 4 ranks" in why and "32-value" in why and "\n" not in why
    with pytest.raises(ValueError, match="over 4 ranks"):
        Mxfp4Experts(8, 64, 720, 0, 4)


def test_dummy_mxfp4_experts_are_codes_and_sane_scales():
    """--load-format dummy fills the packed experts with random codes and scales near the 16-bit dummies' spread."""
    from llmcli.layers.moe import GptOssMoeBlock
    from llmcli.models.loader import load_dummy

    block = GptOssMoeBlock(64, 96, 8, 2, 1.702, 7.0, mxfp4=True)
    load_dummy(block, seed=0)
    e = block.experts
    assert e.gate_up_proj_blocks.dtype == torch.uint8 and len(e.gate_up_proj_blocks.unique()) > 200
    for scales in (e.gate_up_proj_scales, e.down_proj_scales):
        assert scales.dtype == torch.uint8 and 119 <= int(scales.min()) and int(scales.max()) <= 121
    std = values_of(e.down_proj_blocks, e.down_proj_scales).std().item()
    assert 0.005 < std < 0.05


@pytest.mark.parametrize("name,gib", [("gpt-oss-20b", 12.8), ("gpt-oss-120b", 60.8)])
def test_published_gpt_oss_weighs_its_mxfp4_size(name, gib, monkeypatch):
    """What the memory probe counts (the parameters' bytes: ``ModelRunner.weights_bytes``) for the published
    configs built as on CUDA: experts at 4.25 bits, the rest bf16. 120b leaves an H200 about 70 GiB for the KV pool
    and activations."""
    from pathlib import Path

    from transformers import AutoConfig

    from llmcli.kernels import make_backend
    from llmcli.models import build_model

    monkeypatch.setenv("LLMCLI_MOE", "triton")  # built where the kernel runs: packed
    config = AutoConfig.from_pretrained(Path(__file__).resolve().parents[1] / "configs" / name)
    backend = make_backend("torch", config.num_attention_heads, config.num_key_value_heads, 64, 0.125, 16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_model(config, backend, 4096)
    finally:
        torch.set_default_dtype(default)
    packed = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    assert packed * 8 == pytest.approx(config.num_hidden_layers * config.num_local_experts * 3 * 2880 * 2880 * 4.25)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30 == pytest.approx(gib, abs=0.1)


gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1000, 4096])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_at_gpt_oss_20b_shapes(tokens, kernel):
    """32 experts, top-4, hidden 2880, intermediate 2880 (90 groups: partial K and column tiles), biases and the
    clamp, bf16 against a float32 loop over the dequantized weights; twice, the same bits."""
    x, w13, w2, logits = make_case(tokens, 32, 4, 2880, 2880, torch.bfloat16, seed=tokens)
    g = torch.Generator(device="cpu").manual_seed(tokens)
    b13 = torch.randn(32, 5760, generator=g).to(DEVICE, torch.bfloat16)
    b2 = torch.randn(32, 2880, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = route(logits, 4, normalize=True)
    kw = dict(b13=b13, b2=b2, clamp=(1.702, 7.0), kernel=kernel)
    got = fused_moe_mxfp4(x, *w13, *w2, weights, ids, **kw)
    ref = moe_reference(x.float(), values_of(*w13), values_of(*w2), weights, ids,
                        clamp=(1.702, 7.0), b13=b13.float(), b2=b2.float())
    assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert torch.equal(fused_moe_mxfp4(x, *w13, *w2, weights, ids, **kw), got)


@gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU (frag)")
@pytest.mark.parametrize("tokens", [1, 7, 16, 64, 130, 256, 600, 1000, 4096])
def test_frag_equals_scaled_at_gpt_oss_20b_shapes(tokens):
    """``frag`` at the tiles it picks against ``scaled``, both bf16 with the same rounding points: right tiles
    agree within 2e-4 (benchmarks/RESULTS.md T2b), while a tile that gave wrong sums on an H200 (64 x 128 x 64:
    0.0016 to 0.0023) stayed inside the float32 loop's bf16 tolerance above; no clamp, so a wrong value can
    grow."""
    x, w13, w2, logits = make_case(tokens, 32, 4, 2880, 2880, torch.bfloat16, seed=tokens + 1)
    weights, ids = route(logits, 4, normalize=True)
    want = fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="scaled")
    assert rel_err(fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="frag"), want) < 1e-3


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("frag", [False, True], ids=["as-stored", "frag"])
def test_mxfp4_captured_in_a_cuda_graph(frag):
    """Routing, grouping and both MXFP4 GEMMs replay from a graph with new routing each time (``frag``: the experts
    converted once beforehand, as a model holds them)."""
    from llmcli.kernels.mxfp4_fragments import to_fragments
    from llmcli.kernels.triton_moe_mxfp4_frag import fused_moe_mxfp4_frag

    x, w13, w2, logits = make_case(48, 32, 4, 256, 128, torch.bfloat16)
    weights, ids = route(logits, 4, normalize=True)
    if frag:
        f13, f2 = to_fragments(*w13, parts=2), to_fragments(*w2)
        run = lambda: fused_moe_mxfp4_frag(x, f13, f2, weights, ids)  # noqa: E731
    else:
        run = lambda: fused_moe_mxfp4(x, *w13, *w2, weights, ids)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in range(3):
        fresh = make_case(48, 32, 4, 256, 128, torch.bfloat16, seed=100 + seed)[3]
        new_w, new_ids = route(fresh, 4, normalize=True)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, reference(x, w13, w2, new_w, new_ids)) < TOL[torch.bfloat16]


# -- sm_90 -------------------------------------------------------------------------------------------------------------
_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_moe_mxfp4 as m

def build(kernel, constexprs, ptrs, **options):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in kernel.arg_names}
    # what the JIT specializes on a GPU: 16-byte aligned pointers and integers divisible by 16 (strides, 2880);
    # without it Triton pipelines no load into shared memory and builds other code than the GPU runs
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in constexprs and n not in ("num_pairs", "alpha", "limit")}
    built = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=options)
    print("=== compiled", kernel.__name__, constexprs["BLOCK_M"], "scaled" if constexprs["SCALED"] else "dequant")
    print(built.asm["sass"])

PTRS = {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8",
        "pairs_ptr": "*i32", "experts_ptr": "*i32", "total_ptr": "*i32", "weights_ptr": "*fp32",
        "alpha": "fp32", "limit": "fp32"}
for kernel in ("scaled", "dequant"):  # frag's own: tests/test_mxfp4_fragments.py
    for pairs in (64, 1024, 16384):  # gpt-oss-20b's 32 experts top-4: decode, mid and prefill tiles
        t = m.mxfp4_tuning(pairs, 32, kernel)
        tiles = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, PRECISION="tf32",
                     BIAS=True, SCALED=kernel == "scaled", FORMAT="bf16",
                     SETTLE=kernel == "scaled")
        build(m._mxfp4_gate_up_kernel, dict(tiles, TOP_K=4, CLAMPED=True), PTRS, num_warps=t.num_warps,
              num_stages=t.num_stages)
        build(m._mxfp4_down_kernel, tiles, PTRS, num_warps=t.num_warps, num_stages=t.num_stages)
"""


@pytest.mark.slow
def test_mxfp4_kernels_compile_for_sm90():
    """Both kernels, through both tile products, at every tile size gpt-oss-20b picks build for an H100/H200 with
    Triton's own ptxas, no GPU: the interpreter accepts code the compiler rejects (layouts of the in-register
    unpacking, the join, ``dot_scaled``'s operand shapes). No K loop writes a register that an MMA still in flight
    reads (``sass_loops``; ``scaled``'s 64-row tiles feed the MMAs activations from registers). Also on the GPU
    machine, whose Triton 3.6 is the one that needs ``triton_moe.settled``."""
    from sass_loops import k_loop, unwaited_operand_writes
    from sm90_build import build_for_sm90

    builds = build_for_sm90(_COMPILE).split("=== ")[1:]
    assert len(builds) == 6 * 2
    for build in builds:
        name, sass = build.split("\n", 1)
        found = unwaited_operand_writes(k_loop(sass))
        assert not found, (name, found[:3])


# -- a whole model -----------------------------------------------------------------------------------------------------
def tiny_gpt_oss_in_mxfp4(tiny_checkpoint, tmp_path, hf_oracle, run_factory, frag: bool = False, **engine) -> None:
    """The tiny gpt-oss as an MXFP4 checkpoint with its experts kept as codes and scales (loaded as stored, run in
    the MXFP4 kernel; ``frag``: converted to that kernel's layout after loading): transformers' float32 greedy tokens
    on the 16-bit checkpoint of the values its blocks encode."""
    from test_new_families import MAX_NEW, write_mxfp4_twins

    from llmcli.layers.moe_mxfp4 import Mxfp4Experts

    packed, plain = write_mxfp4_twins(tiny_checkpoint("gpt-oss"), tmp_path)
    prompts = random_prompts([9, 40, 70], seed=431)
    want = hf_oracle.greedy(plain, prompts, MAX_NEW)
    run = run_factory(packed, kvcache_block_size=16, max_model_len=256, **engine)
    experts = [m for m in run.llm.engine.model_runner.model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(experts) == 2
    if frag:
        assert experts[0].fragments is not None and not hasattr(experts[0], "gate_up_proj_blocks")
    else:
        assert experts[0].gate_up_proj_blocks.dtype == torch.uint8
    assert [o["token_ids"] for o in run.llm.generate(prompts, greedy(MAX_NEW))] == want
    if frag:  # shutdown gives the memory back while the engine is still referenced: no tensor outside parameters
        run.llm.engine.model_runner.shutdown()
        assert all(t.numel() == 0 for f in experts[0].fragments for t in (f.codes, f.scales))


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the CUDA test below runs the compiled kernel")
def test_tiny_mxfp4_gpt_oss_under_the_interpreter_equals_transformers_on_its_twin(tiny_checkpoint, tmp_path,
                                                                                 hf_oracle, run_factory, monkeypatch):
    """On the CPU, built as on CUDA (LLMCLI_MOE=triton packs the experts where the kernel runs)."""
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    tiny_gpt_oss_in_mxfp4(tiny_checkpoint, tmp_path, hf_oracle, run_factory)


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on CUDA frag takes bfloat16 only: tests/test_gpu_e2e.py -k mxfp4 with "
                                   "LLMCLI_MXFP4_KERNEL=frag (benchmarks/gpu_session.sh mxfp4-model)")
def test_tiny_mxfp4_gpt_oss_through_frag_equals_transformers_on_its_twin(tiny_checkpoint, tmp_path, hf_oracle,
                                                                        run_factory, monkeypatch):
    """``LLMCLI_MXFP4_KERNEL=frag``: the engine converts the experts after loading and every step runs the frag
    kernel (emulated by the interpreter): still exactly transformers' tokens."""
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "frag")
    tiny_gpt_oss_in_mxfp4(tiny_checkpoint, tmp_path, hf_oracle, run_factory, frag=True)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_tiny_mxfp4_gpt_oss_on_cuda_equals_transformers_on_its_twin(tiny_checkpoint, tmp_path, hf_oracle,
                                                                   run_factory):
    """On CUDA in float32 (the kernel's IEEE dots; the torch attention backend): exactly transformers' tokens."""
    tiny_gpt_oss_in_mxfp4(tiny_checkpoint, tmp_path, hf_oracle, run_factory, device="cuda",
                          attention_backend="torch")
