"""llmcli's Triton attention with a sliding window and at head dim 256, against a plain masked softmax
(tests/attention_reference.py) and the torch backend.

Without CUDA the kernels run under Triton's interpreter (float32 and float16, tiny sizes); cache blocks no query
can see are NaN, so a kernel that reads one (rather than skipping its tile) fails. With CUDA the ``gpu`` cases
run bfloat16 at model sizes against the torch backend. The sm_90 compile check (no GPU needed) builds every
model's variants: windows, head dims 256 and 512, sinks.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from attention_reference import interpret_triton_without_cuda, paged_case, rel_err

ON_GPU = interpret_triton_without_cuda()

from llmcli.kernels.backend import AttentionMetadata  # noqa: E402
from llmcli.kernels.torch_backend import TorchAttentionBackend  # noqa: E402
from llmcli.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from llmcli.kernels.triton_decode import (  # noqa: E402
    DEFAULT_TUNING, HEAD256_TUNING, default_tuning, paged_decode, scratch_numel,
)
from llmcli.kernels.triton_prefill import (  # noqa: E402
    HEAD256, LARGE, SMALL, WIDE, Tiles, _tiles, prefill_paged, prefill_varlen,
)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 5e-3 if ON_GPU else 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def run_prefill(case, window, paged, tiles=None):
    out = nan_like(case.q)
    max_q = int((case.cu_q[1:] - case.cu_q[:-1]).max())
    scale = case.q.shape[-1] ** -0.5
    if paged:
        prefill_paged(case.q, case.k, case.v, case.k_cache, case.v_cache, case.tables, case.cu_q, case.lens, max_q,
                      scale, out=out, tiles=tiles, window=window)
    else:
        prefill_varlen(case.q, case.k, case.v, case.cu_q, max_q, scale, out=out, tiles=tiles, window=window)
    return out


def run_decode(case, window, num_splits):
    batch, num_heads, head_dim = case.q.shape
    n_out, n_lse = scratch_numel(batch, num_heads, head_dim, num_splits)
    part_out = torch.full((max(n_out, 1),), float("nan"), device=DEVICE)
    part_lse = torch.full((max(n_lse, 1),), float("nan"), device=DEVICE)
    out = nan_like(case.q)
    paged_decode(case.q, case.k_cache, case.v_cache, case.tables, case.lens, head_dim ** -0.5, num_splits, part_out,
                 part_lse, out=out, window=window)
    return out


def check(out, case, dtype):
    assert torch.isfinite(out).all(), "unwritten output, or a key outside the window was read"
    assert rel_err(out, case.ref) <= TOL[dtype]


# -- prefill ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 33, 1000])
def test_prefill_varlen_window_shorter_than_the_prompt(dtype, window):
    """Chunks of 1, 37 and 100 tokens: diagonal tiles, tiles wholly before a query tile's window (skipped), tiles
    every query sees (unmasked) and the window's edge (masked); 1000: a window longer than every chunk."""
    shape = (4, 2, 32, 16)
    case = paged_case([0, 0, 0], [1, 37, 100], shape, dtype, DEVICE, window)
    check(run_prefill(case, window, paged=False), case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 24, 50])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_chunks_after_a_cached_prefix_across_the_window_edge(dtype, window, block_size):
    """Chunked prefill: prefixes shorter than the window, crossing its edge inside a key tile, and many windows
    long (their early blocks NaN: never read); 1-token chunks beside long ones."""
    shape = (6, 2, 32, block_size)
    case = paged_case([0, 21, 64, 130, 300], [40, 1, 77, 20, 2], shape, dtype, DEVICE, window)
    assert case.poisoned_blocks > 0
    check(run_prefill(case, window, paged=True), case, dtype)


# key tiles inside one cache block and across several (64 > 16), the one-loop variant, a GQA group of 5
@pytest.mark.parametrize("tiles", [Tiles(16, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(64, 32, 4, 2, one_loop=True)],
                         ids=["16x16", "64x64", "64x32-1loop"])
def test_prefill_window_with_every_tile_shape(tiles):
    shape = (10, 2, 32, 16)
    for paged in (False, True):
        prefix = [0, 0, 0] if not paged else [45, 3, 100]
        case = paged_case(prefix, [40, 9, 23], shape, torch.float32, DEVICE, 21, seed=1)
        check(run_prefill(case, 21, paged, tiles), case, torch.float32)


# -- decode -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,block_size", [(1, 16), (40, 16), (100, 64)])
def test_decode_context_many_windows_long(dtype, num_splits, window, block_size):
    """Contexts up to ~15 windows long, split or not: only the window's tiles are read (the earlier blocks are
    NaN), the splits share them."""
    shape = (8, 2, 32, block_size)
    lens = [1, 39, 41, 130, 600]
    case = paged_case([n - 1 for n in lens], [1] * len(lens), shape, dtype, DEVICE, window)
    check(run_decode(case, window, num_splits), case, dtype)


# -- head dim 256 ---------------------------------------------------------------------
def test_head_dim_256_launch_choices():
    """Head dim 256 gets its own prefill tiles and half-length decode key tiles; <= 128 keeps the measured ones."""
    assert _tiles(256, 2, 16, 4) == HEAD256 and _tiles(256, 2, 8192, 4) == HEAD256
    assert _tiles(256, 4, 16, 4) == HEAD256
    assert _tiles(128, 2, 16, 2) == SMALL and _tiles(128, 2, 200, 2) == LARGE and _tiles(128, 4, 16, 2) == WIDE
    assert default_tuning(256) == HEAD256_TUNING and HEAD256_TUNING.block_n == 32
    assert default_tuning(128) == default_tuning(64) == DEFAULT_TUNING
    assert TritonAttentionBackend(16, 4, 256, 0.1, 16).decode_tuning == HEAD256_TUNING


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_head_dim_256_prefill_and_decode(dtype, window):
    """Qwen3.5's full-attention and Gemma 3's head size, through the default launch shapes."""
    shape = (4, 1, 256, 16)
    case = paged_case([0, 40], [50, 9], shape, dtype, DEVICE, window)
    check(run_prefill(case, window, paged=True), case, dtype)
    dec = paged_case([70, 5], [1, 1], shape, dtype, DEVICE, window)
    check(run_decode(dec, window, 2), dec, dtype)


# -- the backend ------------------------------------------------------------------
def test_backend_mixed_step_with_a_window_matches_torch():
    """A mixed step (decode rows, then prompt chunks with and without a prefix) through both backends' forward,
    window and all; the split count of a windowed layer follows the window, never above the step's."""
    shape = (8, 2, 32, 16)
    prefix, q_lens = [300, 5, 200, 0], [1, 1, 30, 25]
    case = paged_case(prefix, q_lens, shape, torch.float32, DEVICE, 24)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.full_like(case.slots, -1), context_lens=case.lens,
                             block_tables=case.tables, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
                             max_seqlen_q=30, max_seqlen_k=int(case.lens.max()), has_prefix=True, num_decode=2,
                             rest_max_seqlen_q=30, rest_has_prefix=True)
    triton_backend = TritonAttentionBackend(8, 2, 32, 32 ** -0.5, 16)
    torch_backend = TorchAttentionBackend(8, 2, 32, 32 ** -0.5, 16)
    for backend in (triton_backend, torch_backend):
        backend.prepare(meta)
    got = triton_backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, window=24)
    ref = torch_backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, window=24)
    check(got, case, torch.float32)
    assert rel_err(got, ref) <= TOL[torch.float32]
    assert 1 <= triton_backend._decode_splits(24) <= triton_backend._decode_splits(None)


def in_slab(k_cache: torch.Tensor, v_cache: torch.Tensor, width: int, at: int):
    """``k_cache`` and ``v_cache`` copied into views of a pool whose block rows hold ``width`` elements per token,
    K at ``at`` and V right after it, everything else NaN (Gemma 4's pool, engine/kv_cache.py: the other layers of
    the group lie beside this one); (the slab, K's view, V's view)."""
    blocks, bs, heads, dim = k_cache.shape
    n = heads * dim
    slab = torch.full((blocks, bs * width), float("nan"), dtype=k_cache.dtype, device=k_cache.device)
    k_view = slab[:, bs * at:bs * (at + n)].view(k_cache.shape)
    v_view = slab[:, bs * (at + n):bs * (at + 2 * n)].view(k_cache.shape)
    k_view.copy_(k_cache)
    v_view.copy_(v_cache)
    return slab, k_view, v_view


def test_backend_over_views_of_a_wider_slab_matches_torch():
    """A layer's K and V as views into block rows three layers wide (Gemma 4's pool): a mixed step through both
    backends stores the new tokens in this layer's part of the row (their slots start as NaN, and decode rows
    read them back) and reads nothing of the rest; the same outputs as over plain caches."""
    shape = (8, 2, 32, 16)
    prefix, q_lens = [300, 5, 200, 0], [1, 1, 30, 25]
    case = paged_case(prefix, q_lens, shape, torch.float32, DEVICE, 24)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=case.slots, context_lens=case.lens,
                             block_tables=case.tables, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
                             max_seqlen_q=30, max_seqlen_k=int(case.lens.max()), has_prefix=True, num_decode=2,
                             rest_max_seqlen_q=30, rest_has_prefix=True)
    outs = []
    for backend in (TritonAttentionBackend(8, 2, 32, 32 ** -0.5, 16), TorchAttentionBackend(8, 2, 32, 32 ** -0.5, 16)):
        slab, k_cache, v_cache = in_slab(case.k_cache, case.v_cache, 6 * 2 * 32, 2 * 2 * 32)
        assert not k_cache.is_contiguous()  # blocks a slab's row apart
        for cache in (k_cache, v_cache):
            cache[case.slots // 16, case.slots % 16] = float("nan")
        backend.prepare(meta)
        outs.append(backend.forward(case.q, case.k, case.v, k_cache, v_cache, window=24))
        outside = torch.ones(slab.shape[1], dtype=torch.bool, device=slab.device)
        outside[16 * 2 * 2 * 32:16 * 4 * 2 * 32] = False
        assert torch.isnan(slab[:, outside]).all(), f"{backend.name} wrote outside its layer's part of the slab"
        assert torch.equal(k_cache[case.slots // 16, case.slots % 16], case.k)
    for out in outs:
        check(out, case, torch.float32)
    assert rel_err(outs[0], outs[1]) <= TOL[torch.float32]


def test_backend_decode_splits_of_a_window_follow_its_length():
    """Batch 1 over 8k keys splits wide; a 128-key window of the same step needs one split, and a window longer
    than the context the step's own count."""
    backend = TritonAttentionBackend(8, 2, 32, 0.1, 16)
    backend.prepare(AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(1, dtype=torch.int64),
                                      context_lens=torch.tensor([8192], dtype=torch.int32),
                                      block_tables=torch.zeros(1, 512, dtype=torch.int32), max_seqlen_k=8192))
    assert backend.num_splits > 8
    assert backend._decode_splits(128) == 1
    assert backend._decode_splits(10**6) == backend._decode_splits(None) == backend.num_splits


# -- sm_90 ---------------------------------------------------------------------------
# a script's first part: build(kernel, constexprs, ptrs) compiles one variant for sm_90 (Triton's ptxas, no GPU),
# checks it within Hopper's 227 KiB of shared memory and returns its shared bytes; PTRS types every kernel's pointer
COMPILE_HEADER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_decode as td, triton_prefill as tp

def build(kernel, constexprs, ptrs, **options):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    return compiled.metadata.shared

BF16 = dict.fromkeys(("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr",
                      "sinks_ptr"), "*bf16")
PTRS = {**BF16, "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "row_order_ptr": "*i64", "scale_log2": "fp32",
        "v_scale": "fp32", "qk_scale": "fp32", "k_scale": "fp32"}
"""
_COMPILE = COMPILE_HEADER + r"""
def decode(head_dim, group, windowed, sinks=False, split=True):
    tuning = td.default_tuning(head_dim)
    return build(td._decode_partition_kernel, dict(
        GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_N=tuning.block_n, SPLIT=split,
        HEADS_FASTEST=True, FP8=False, WINDOWED=windowed, SINKS=sinks), PTRS, num_warps=tuning.num_warps,
        num_stages=tuning.num_stages)

def prefill(head_dim, group, windowed, sinks=False):
    t = tp._tiles(head_dim, 2, 16, group)
    return build(tp._prefill_kernel, dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PAGED=True,
        QPT=t.block_m // group, ONE_LOOP=t.one_loop, FP8=False, WINDOWED=windowed, SINKS=sinks), PTRS,
        num_warps=t.num_warps, num_stages=t.num_stages)

# each variant a model runs (a prefill build takes ~10 s cold, so no others): Mistral's windowed 128, Gemma 3's and
# Gemma 4's local windowed 256, Qwen3.5's full 256 (full 128: tests/test_triton_kernels.py), Gemma 4's global full 512
for head_dim, group, windowed in ((128, 4, True), (256, 4, True), (256, 4, False), (512, 8, False)):
    print("decode", head_dim, windowed, decode(head_dim, group, windowed))
    print("prefill", head_dim, windowed, prefill(head_dim, group, windowed))
# gpt-oss: head dim 64, 8 heads per KV head, windowed layers with sinks; the split decode adds them in its reduce
for split in (True, False):
    print("sinks-decode", split, decode(64, 8, True, sinks=True, split=split))
print("sinks-reduce", build(td._decode_reduce_kernel, dict(HEAD_DIM=64, MAX_SPLITS_PAD=td.MAX_SPLITS, SINKS=True),
                            PTRS, num_warps=4))
print("sinks-prefill", prefill(64, 8, True, sinks=True))
"""


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests here compile and run these kernels for real")
def test_attention_kernel_variants_compile_for_sm90():
    """The windowed, head-dim-256 and -512 (Gemma 4) and sink (gpt-oss) variants build for an H100/H200 (Triton's
    own ptxas, no GPU) within its 227 KiB of shared memory: the interpreter accepts code the compiler rejects. One
    process for all of them: each start imports torch and Triton."""
    built = [line.split()[0] for line in compile_for_sm90(_COMPILE).splitlines()]  # each print: what, its bytes
    assert built == ["decode", "prefill"] * 4 + ["sinks-decode"] * 2 + ["sinks-reduce", "sinks-prefill"], built


def compile_for_sm90(script: str) -> str:
    """Run ``script`` (building kernels for sm_90) outside the interpreter; its stdout."""
    from processes import compiled_without_interpreter

    return compiled_without_interpreter(script, timeout=600)


# -- GPU: bfloat16 at model sizes against the torch backend ------------------------------
def torch_reference(case, shape, window, decode):
    num_heads, num_kv_heads, head_dim, block_size = shape
    ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, block_size)
    ref.prepare(AttentionMetadata(is_prefill=not decode, slot_mapping=torch.full_like(case.slots, -1),
                                  context_lens=case.lens, block_tables=case.tables,
                                  cu_seqlens_q=None if decode else case.cu_q,
                                  cu_seqlens_k=None if decode else case.cu_k, has_prefix=not decode))
    return ref.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 1024, 4096])
@pytest.mark.parametrize("shape", [(16, 8, 256, 16), (32, 16, 256, 256), (16, 8, 128, 256), (32, 8, 128, 16)])
def test_gpu_bf16_window_and_head_dim_256_match_torch(window, shape):
    """Gemma-3-12B-like (16/8/256) and Qwen3.5-like (32/16/256 is wider than any: it bounds them) heads and
    Mistral-7B's (32/8/128): long chunked prefills with prefixes of several windows, and decode over contexts up to
    ~8 windows, in bfloat16, through the kernels' default launch shapes."""
    check_bf16_against_torch(shape, window)


def check_bf16_against_torch(shape, window):
    """Prefill (paged, behind prefixes, and plain) and decode at 1 and 8 splits, bf16, against the torch backend."""
    dtype = torch.bfloat16
    case = paged_case([0, 6000, 1500, 9000], [3000, 2048, 700, 1], shape, dtype, DEVICE, window, with_ref=False)
    got = run_prefill(case, window, paged=True)
    assert torch.isfinite(got).all() and rel_err(got, torch_reference(case, shape, window, False)) <= 1e-2
    lens = [1, 1000, 5000, 9000, 12000, 333]
    dec = paged_case([n - 1 for n in lens], [1] * len(lens), shape, dtype, DEVICE, window, with_ref=False)
    for splits in (1, 8):
        got = run_decode(dec, window, splits)
        assert torch.isfinite(got).all() and rel_err(got, torch_reference(dec, shape, window, True)) <= 1e-2
    plain = paged_case([0, 0], [4000, 513], shape, dtype, DEVICE, window, with_ref=False)
    got = run_prefill(plain, window, paged=False)
    assert rel_err(got, torch_reference(plain, shape, window, False)) <= 1e-2
