"""The Triton attention kernels against the torch reference backend.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set below before any kernel module is imported), in float32 and float16 only:
the interpreter's bfloat16 dot is wrong. With CUDA they run on the GPU, in
bfloat16 too, plus larger, GPU-only shapes. Inputs are fresh random draws each
run, block tables are random permutations of block ids, and outputs (and the
split-KV scratch) are poisoned with NaN so that an unwritten element fails.
"""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    # triton picks interpreter vs compiler when a kernel is decorated: redo it if imported earlier
    for _name in ("triton_store", "triton_elementwise", "triton_decode", "triton_prefill", "triton_backend",
                  "triton_sample", "triton_sample_filter", "triton_logprobs"):
        if f"llmcli.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"llmcli.kernels.{_name}"])

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llmcli.kernels import make_backend  # noqa: E402
from llmcli.kernels import triton_elementwise as te  # noqa: E402
from llmcli.kernels.backend import AttentionMetadata, QKNormRotary  # noqa: E402
from llmcli.kernels.torch_backend import TorchAttentionBackend, store_kv_torch  # noqa: E402
from llmcli.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from llmcli.kernels.triton_decode import (  # noqa: E402
    choose_num_splits, paged_decode, scratch_numel,
)
from llmcli.kernels.triton_prefill import LARGE, LONG, SMALL, Tiles, prefill_paged, prefill_varlen  # noqa: E402
from llmcli.kernels.triton_sample import CHUNK, _gumbel, sample_unfiltered  # noqa: E402
from llmcli.kernels import triton_sample  # noqa: E402
from llmcli.kernels import triton_logprobs  # noqa: E402
from llmcli.kernels.triton_store import store_kv  # noqa: E402
from llmcli.layers.sampler import row_keys, sample  # noqa: E402
from llmcli.engine.warmup import compile_variants  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# float32 on the GPU goes through tf32 tensor cores; the interpreter computes it exactly
TOL = {torch.float32: 5e-3 if ON_GPU else 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
gpu_only = pytest.mark.skipif(not ON_GPU, reason="GPU-sized cases need CUDA")

# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1/2/4/8, Qwen3-0.6B's 16/8/128
SHAPES = [(8, 8, 64, 16), (8, 4, 128, 64), (8, 2, 64, 256), (8, 1, 128, 16), (16, 8, 128, 256)]
# a GQA group of 7, not a power of two: Qwen2.5-0.5B's 14/2/64 (Qwen2.5-7B's 28/4/128 has the same group)
QWEN25_SHAPE = (14, 2, 64, 16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_case(ctx_lens, q_lens, num_kv_heads, head_dim, block_size, dtype):
    """A paged cache full of random KV, random permuted block tables (-1 padded), the new tokens' slots."""
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks).tolist()
    width = max(per_seq + [1]) + 1  # one spare column of -1 padding
    tables = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    slots = []
    used = 0
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        tables[i, : per_seq[i]] = torch.tensor(perm[used : used + per_seq[i]], dtype=torch.int32)
        used += per_seq[i]
        for p in range(max(c - n, 0), c):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
        slots += [-1] * (n - min(n, c))  # decode padding rows: a token with nowhere to go
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    return k_cache, v_cache, tables.to(DEVICE), torch.tensor(slots, dtype=torch.int64, device=DEVICE)


def reference(meta, q, k, v, k_cache, v_cache, num_heads, scale):
    ref = TorchAttentionBackend(num_heads, k.shape[1], q.shape[2], scale, k_cache.shape[1] if k_cache is not None else 16)
    ref.prepare(meta)
    return ref.forward(q, k, v, k_cache, v_cache)


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# -- store ------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_torch(block_size, dtype):
    num_kv_heads, head_dim, num_tokens = 2, 64, 40
    k_cache, v_cache, _, _ = make_case([3 * block_size], [0], num_kv_heads, head_dim, block_size, dtype)
    slots = torch.randperm(k_cache.shape[0] * block_size, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, device=DEVICE)[:7]] = -1
    # k/v as strided slices of a fused projection, as the model produces them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, dtype=dtype, device=DEVICE)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    store_kv_torch(k, v, kc_ref, vc_ref, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


# -- decode -----------------------------------------------------------------------
def decode_case(ctx_lens, shape, dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    batch = len(ctx_lens)
    k_cache, v_cache, tables, slots = make_case(ctx_lens, [1] * batch, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(batch, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, context_lens=lens, block_tables=tables,
                             max_seqlen_k=max(ctx_lens))
    ref = reference(meta, q, k, v, k_cache.clone(), v_cache.clone(), num_heads, head_dim ** -0.5)
    store_kv(k, v, k_cache, v_cache, slots)
    return q, k_cache, v_cache, tables, lens, ref


def check_decode(ctx_lens, shape, dtype, num_splits):
    q, k_cache, v_cache, tables, lens, ref = decode_case(ctx_lens, shape, dtype)
    batch, num_heads, head_dim = q.shape
    out = nan_like(q.shape, dtype)
    n_out, n_lse = scratch_numel(batch, num_heads, head_dim, num_splits)
    part_out, part_lse = nan_like((max(n_out, 1),), torch.float32), nan_like((max(n_lse, 1),), torch.float32)
    paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, num_splits, part_out, part_lse, out=out)
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    assert (out[lens == 0] == 0).all(), "padding rows must be zeros"
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("shape", SHAPES + [QWEN25_SHAPE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_torch(shape, dtype, num_splits):
    block_size = shape[3]
    # one token, tile/block edges, a padding row, a context too short to reach every split
    lens = [1, 0, block_size, block_size + 1, 64, 65, 130] + torch.randint(1, 400, (2,)).tolist()
    check_decode(lens, shape, dtype, num_splits)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_many_splits_long_context(batch):
    lens = torch.randint(500, 1200, (batch,)).tolist()
    check_decode(lens, (16, 8, 128, 256), torch.float16, choose_num_splits(batch, 8, max(lens)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_row_order_changes_no_bit(dtype, num_splits):
    """The launch order (``row_order``, the engine's rows longest first, padding rows last) and the grid's
    layout (``heads_fastest``) decide only when each program runs: every row, padding included, written with
    the bits of the plain launch, whatever the permutation (a program that wrote to its launch slot instead
    of its row, or read the wrong row's length, breaks it)."""
    from dataclasses import replace

    from llmcli.engine.step_inputs import longest_first
    from llmcli.kernels.triton_decode import DEFAULT_TUNING

    lens = [40, 0, 300, 1, 130, 65, 0, 700]
    q, k_cache, v_cache, tables, ctx, ref = decode_case(lens, (8, 2, 64, 16), dtype)
    batch, num_heads, head_dim = q.shape

    def run(tuning, order=None):
        out = nan_like(q.shape, dtype)
        n_out, n_lse = scratch_numel(batch, num_heads, head_dim, num_splits)
        part_out, part_lse = nan_like((max(n_out, 1),), torch.float32), nan_like((max(n_lse, 1),), torch.float32)
        return paged_decode(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5, num_splits, part_out, part_lse,
                            out=out, tuning=tuning, row_order=order)

    plain = run(replace(DEFAULT_TUNING, heads_fastest=False))
    assert torch.isfinite(plain).all() and rel_err(plain, ref) <= TOL[dtype]
    order = longest_first(np.array(lens))
    assert [lens[i] for i in order] == sorted(lens, reverse=True) and sorted(order.tolist()) == list(range(batch))
    orders = [order, order[::-1].copy(), np.random.default_rng(0).permutation(batch)]
    for perm in orders:
        got = run(DEFAULT_TUNING, torch.tensor(perm, dtype=torch.int64, device=DEVICE))
        assert torch.equal(got, plain), f"launch order {perm.tolist()} changed the output"
    assert torch.equal(run(DEFAULT_TUNING), plain)  # heads side by side, rows as they come


@gpu_only
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
@pytest.mark.parametrize("max_ctx", [1024, 8192])
@pytest.mark.parametrize("shape", [(16, 8, 128, 256), (16, 8, 128, 16), (32, 4, 128, 64), (8, 1, 64, 256)])
def test_decode_gpu_sizes(batch, max_ctx, shape):
    max_ctx = min(max_ctx, 2048) if batch > 64 else max_ctx  # keep the pool a few GiB at most
    lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    lens[0] = max_ctx
    check_decode(lens, shape, torch.bfloat16, choose_num_splits(batch, shape[1], max_ctx))


# Compiles (no GPU needed: Triton's bundled ptxas) the decode kernels for an H100/H200 in a fresh process
# without the interpreter, which accepts code the compiler rejects.
_COMPILE_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_decode as td

PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
        "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "scale_log2": "fp32", "row_order_ptr": "*i64", "v_scale": "fp32"}

def build(kernel, constexprs, ptrs=PTRS, **options):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

for group in (1, 2, 4):
    for split, ordered in ((True, True), (False, True), (False, False)):
        order = {} if ordered else {"row_order_ptr": None}  # the engine's launch has an order; a bare call not
        build(td._decode_partition_kernel, dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=256,
              BLOCK_N=td.BLOCK_N, SPLIT=split, HEADS_FASTEST=ordered, FP8=False, WINDOWED=False, SINKS=False,
              **order),
              num_warps=td.NUM_WARPS, num_stages=td.NUM_STAGES)
        print("partition compiled: group", group, "split", split, "ordered", ordered)
# an FP8 KV cache: e4m3 tiles widened to q's bf16 for the dots
build(td._decode_partition_kernel, dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_N=td.BLOCK_N,
      SPLIT=True, HEADS_FASTEST=True, FP8=True, WINDOWED=False, SINKS=False),
      {**PTRS, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"},
      num_warps=td.NUM_WARPS, num_stages=td.FP8_NUM_STAGES)
print("fp8 partition compiled")
build(td._decode_reduce_kernel, dict(HEAD_DIM=128, MAX_SPLITS_PAD=td.MAX_SPLITS, SINKS=False), num_warps=td.NUM_WARPS)
print("reduce compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the decode tests compile and run these kernels for real")
def test_decode_kernels_compile_for_sm90():
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("partition compiled") == 10 and out.count("reduce compiled") == 1, out


def test_backend_split_decode_layer_after_layer():
    """Through the backend (its own scratch, reused by every layer), as a decode step runs."""
    shape = (16, 8, 128, 256)
    lens = [400, 0, 300, 1]
    q, k_cache, v_cache, tables, len_t, ref = decode_case(lens, shape, torch.float32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((4,), -1, dtype=torch.int64, device=DEVICE),
                             context_lens=len_t, block_tables=tables, max_seqlen_k=max(lens))
    backend = TritonAttentionBackend(16, 8, 128, 128 ** -0.5, 256)
    backend.init_graph_buffers(8, tables.shape[1], DEVICE)
    backend.prepare(meta)
    assert backend.num_splits > 1  # small batch: the split path is what this test is about
    kv = torch.zeros(4, 8, 128, device=DEVICE)  # not stored (slot -1)
    outs = [backend.forward(q, kv, kv, k_cache, v_cache) for _ in range(3)]  # three "layers"
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert rel_err(outs[0], ref) <= TOL[torch.float32]


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 8192) >= 16  # small batch, long context: spread over the SMs
    assert choose_num_splits(256, 8, 8192) == 1  # enough programs already
    assert choose_num_splits(1, 8, 100) == 1  # too short to split
    assert choose_num_splits(1, 1, 10**6) <= 64
    # at least one (row, KV head) program per SM: no split (Qwen2.5-7B's 4 KV heads at batch 33 and up)
    assert choose_num_splits(33, 4, 40960, 132) == 1 and choose_num_splits(32, 4, 40960, 132) > 1


def test_decode_pipeline_depth_by_cache_dtype():
    from llmcli.kernels.triton_decode import DEFAULT_TUNING, FP8_NUM_STAGES, decode_stages

    assert decode_stages(DEFAULT_TUNING, torch.bfloat16) == DEFAULT_TUNING.num_stages == 5
    assert decode_stages(DEFAULT_TUNING, torch.float8_e4m3fn) == FP8_NUM_STAGES == 3
    assert decode_stages(DEFAULT_TUNING, torch.float32) == 2


# -- prefill ----------------------------------------------------------------------
def check_prefill(prefix_lens, q_lens, shape, dtype, paged, tiles=None, poison_tails=False):
    num_heads, num_kv_heads, head_dim, block_size = shape
    ctx_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    k_cache, v_cache, tables, slots = make_case(ctx_lens, q_lens, num_kv_heads, head_dim, block_size, dtype)
    if poison_tails:  # the unused slots of each sequence's last block: a key read past the context shows up as NaN
        for i, c in enumerate(ctx_lens):
            if c % block_size:
                last = int(tables[i, (c - 1) // block_size])
                k_cache[last, c % block_size:] = float("nan")
                v_cache[last, c % block_size:] = float("nan")
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(ctx_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, context_lens=lens,
                             block_tables=tables if paged else None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx_lens), has_prefix=paged)
    scale = head_dim ** -0.5
    ref = reference(meta, q, k, v, k_cache.clone(), v_cache.clone(), num_heads, scale)
    out = nan_like(q.shape, dtype)
    if paged:
        store_kv(k, v, k_cache, v_cache, slots)
        prefill_paged(q, k, v, k_cache, v_cache, tables, cu_q, lens, max(q_lens), scale, out=out, tiles=tiles)
    else:
        prefill_varlen(q, k, v, cu_q, max(q_lens), scale, out=out, tiles=tiles)
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("shape", SHAPES + [QWEN25_SHAPE])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_prefix_matches_torch(shape, dtype):
    bs = shape[3]
    # no prefix; prefix off the block grid with a 1-token chunk; block-aligned prefix;
    # a chunk spanning two 64-row query tiles behind an unaligned prefix
    prefix = [0, bs + 3, 2 * bs, 37]
    q_lens = [45, 1, 20, 100]
    check_prefill(prefix, q_lens, shape, dtype, paged=True)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_prefill_mixed_step_matches_torch(shape):
    """A mixed step: decode rows (1-token chunks over long contexts) beside a prompt chunk without prefix."""
    bs = shape[3]
    check_prefill([bs + 5, 3, 2 * bs, 0, 70], [1, 1, 1, 60, 1], shape, torch.float32, paged=True)


def test_mixed_step_gives_the_prefill_kernel_aligned_views(monkeypatch):
    """Three decode rows before a prompt chunk: ``context_lens[3:]`` starts 12 bytes in. Triton compiles a kernel
    per 16-byte alignment of each pointer, so the backend must hand the prefill kernel aligned lengths and tables
    (else a mixed step compiles, mid-run, variants no prefill step needed); the output still matches torch."""
    from llmcli.kernels import triton_backend

    num_heads, num_kv_heads, head_dim, bs = SHAPES[1]
    prefix, q_lens = [bs + 5, 3, 2 * bs, 37], [1, 1, 1, 20]
    ctx_lens = [p + n for p, n in zip(prefix, q_lens)]
    k_cache, v_cache, tables, slots = make_case(ctx_lens, q_lens, num_kv_heads, head_dim, bs, torch.float32)
    tables = torch.cat([tables, tables[:, :1]], dim=1) if tables.shape[1] % 4 == 0 else tables  # rows 3: off 16
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, device=DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 1, 2, 3, 23], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(ctx_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    assert lens[3:].data_ptr() % 16 and tables[3:].data_ptr() % 16  # the case this test is about
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, context_lens=lens, block_tables=tables,
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=max(ctx_lens),
                             has_prefix=True, num_decode=3, rest_max_seqlen_q=20, rest_has_prefix=True)
    scale = head_dim ** -0.5
    ref = reference(meta, q, k, v, k_cache.clone(), v_cache.clone(), num_heads, scale)
    seen = []
    real = triton_backend.prefill_paged

    def spy(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *args, **kwargs):
        seen.append((block_tables.data_ptr() % 16, context_lens.data_ptr() % 16, cu_seqlens_q.data_ptr() % 16))
        return real(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_paged", spy)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, bs)
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache)
    assert seen == [(0, 0, 0)]
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_varlen_matches_torch(shape, dtype):
    check_prefill([0, 0, 0, 0], [1, 37, 64, 100], shape, dtype, paged=False)


# every tile shape the kernel may be launched with, on GQA groups of 5 (rows not a multiple of the group), 4 and 1
TILE_SHAPES = [LONG, LARGE, SMALL, Tiles(64, 128, 4, 3), Tiles(16, 16, 4, 1), Tiles(64, 32, 4, 2, one_loop=True)]


@pytest.mark.parametrize("tiles", TILE_SHAPES, ids=lambda t: f"{t.block_m}x{t.block_n}" + ("-1loop" if t.one_loop else ""))
@pytest.mark.parametrize("shape", [(10, 2, 32, 16), (8, 2, 32, 64), (4, 4, 16, 256)])
def test_prefill_tiles_and_groups_match_torch(tiles, shape):
    """Diagonal tiles of odd-length chunks, with and without a cached prefix (on and off the block and key-tile
    grid), key tiles inside one cache block and across several; the tail of each last block is NaN."""
    check_prefill([0, 0, 0, 0], [1, 3, 77, 131], shape, torch.float32, paged=False, tiles=tiles)
    check_prefill([0, 21, 64, 130, 5], [131, 1, 77, 40, 2], shape, torch.float32, paged=True, tiles=tiles,
                  poison_tails=True)


@pytest.mark.parametrize("paged", [False, True])
def test_prefill_default_large_tiles_fp16(paged):
    """Chunks long enough for the default LARGE tiles, in float16, Qwen3-0.6B's and -8B's head shapes."""
    for shape in [(16, 8, 128, 256), (32, 8, 128, 16)]:
        check_prefill([0, 300, 0] if paged else [0, 0, 0], [129, 200, 7], shape, torch.float16, paged=paged,
                      poison_tails=paged)


@gpu_only
@pytest.mark.parametrize("prefix,q_lens", [
    ([0], [8192]), ([4000, 0, 777, 8191], [2048, 513, 1, 1]), ([0] * 16, [256] * 16), ([5000, 123], [3000, 900]),
])
@pytest.mark.parametrize("shape", [(16, 8, 128, 256), (16, 8, 128, 16), (32, 4, 128, 64), (8, 1, 64, 256)])
def test_prefill_gpu_sizes(prefix, q_lens, shape):
    check_prefill(prefix, q_lens, shape, torch.bfloat16, paged=True)
    if not any(prefix):
        check_prefill(prefix, q_lens, shape, torch.bfloat16, paged=False)


# -- the backend as the model runner drives it -------------------------------------
@pytest.mark.xfail(reason="module identity after another test reloads kernels; passes alone (2026-12-03)", strict=False)
def test_make_backend_triton():
    assert isinstance(make_backend("triton", 16, 8, 128, 0.1, 256), TritonAttentionBackend)


def test_backend_decode_through_graph_buffers():
    """prepare_for_replay pads the batch (slot -1, length 0) and fixes max_seqlen_k to the table width."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    dtype, n, padded = torch.float32 if not ON_GPU else torch.bfloat16, 3, 8
    ctx_lens = [5, 100, 300]
    k_cache, v_cache, tables, slots = make_case(ctx_lens, [1] * n, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(padded, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(padded, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots,
                             context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
                             block_tables=tables, max_seqlen_k=max(ctx_lens))
    scale = head_dim ** -0.5
    ref = reference(meta, q[:n], k[:n], v[:n], k_cache.clone(), v_cache.clone(), num_heads, scale)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, block_size)
    backend.init_graph_buffers(16, 64, DEVICE)  # 64 blocks of 16: 1024 keys wide
    backend.prepare_for_replay(meta, padded)
    assert backend.num_splits > 1, "a small batch over a wide table should split"
    out = backend.forward(q, k, v, k_cache, v_cache)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert (out[n:] == 0).all()
    assert rel_err(out[:n], ref) <= TOL[dtype]


def test_backend_fuses_the_qk_transform_with_its_store_through_graph_buffers():
    """A decode step padded to a graph batch (slots -1 past the real rows) and a prefill over cached prefixes:
    handed the un-normalised q/k and a QKNormRotary, the backend gives the output and the cache of the q/k kernel
    followed by its plain forward, bit for bit."""
    from llmcli.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    dtype, n, padded = torch.float32 if not ON_GPU else torch.bfloat16, 3, 8
    rotary = RotaryEmbedding(head_dim, 512, 1_000_000.0).to(DEVICE)
    weights = [1 + 0.1 * torch.randn(head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    scale = head_dim ** -0.5
    ctx_lens, q_lens = [5, 100, 300], [1, 1, 1]
    for prefill in (False, True):
        if prefill:
            q_lens = [4, 37, 2]
        k_cache, v_cache, tables, slots = make_case(ctx_lens, q_lens, num_kv_heads, head_dim, block_size, dtype)
        rows = padded if not prefill else sum(q_lens)
        qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(rows, -1, head_dim) for t in (q, k, v))
        positions = torch.cat([torch.arange(c - n_q, c, device=DEVICE) for c, n_q in zip(ctx_lens, q_lens)])
        positions = torch.cat([positions, positions.new_zeros(rows - positions.numel())])
        transform = QKNormRotary(positions, *weights, 1e-6, rotary.cos, rotary.sin)
        lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
        if prefill:
            cu = torch.tensor([0, 4, 41, 43], dtype=torch.int32, device=DEVICE)
            meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, context_lens=lens, block_tables=tables,
                                     cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=37, max_seqlen_k=300,
                                     has_prefix=True)
        else:
            meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, context_lens=lens, block_tables=tables,
                                     max_seqlen_k=max(ctx_lens))
        outs, caches = [], []
        for fused in (False, True):
            backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, block_size)
            backend.init_graph_buffers(16, 64, DEVICE)
            backend.prepare(meta) if prefill else backend.prepare_for_replay(meta, padded)
            kc, vc = k_cache.clone(), v_cache.clone()
            if fused:
                outs.append(backend.forward(q, k, v, kc, vc, qk_norm=transform))
            else:
                qn, kn = te.qk_norm_rotary(q, k, positions, *weights, 1e-6, rotary.cos, rotary.sin)
                outs.append(backend.forward(qn, kn, v, kc, vc))
            caches.append((kc, vc))
        assert torch.equal(outs[0], outs[1])
        assert all(torch.equal(a, b) for a, b in zip(*caches))
        assert not torch.equal(caches[1][0], k_cache) and not torch.equal(caches[1][1], v_cache)


def test_backend_prefill_warmup_without_cache():
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    dtype = torch.float16
    q_lens = [3, 70]
    cu = torch.tensor([0, 3, 73], dtype=torch.int32, device=DEVICE)
    q = torch.randn(73, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(73, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
                             context_lens=torch.tensor(q_lens, dtype=torch.int32, device=DEVICE), block_tables=None,
                             cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70, max_seqlen_k=70)
    backend = make_backend("triton", num_heads, num_kv_heads, head_dim, head_dim ** -0.5, 256)
    backend.prepare(meta)
    out = backend.forward(q, k, v, None, None)
    ref = reference(meta, q, k, v, None, None, num_heads, head_dim ** -0.5)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL[dtype]


# --------------------------------------------------------------------------
# the whole engine on the triton backend (CPU: interpreter, float32)
# --------------------------------------------------------------------------
from test_engine_vs_hf import check_against_hf, random_prompts, run_factory  # noqa: E402,F401  (a fixture)


@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
def test_engine_on_triton_backend_matches_hf(tiny_model, hf_oracle, run_factory):
    """Chunked prefill over cached prefixes, prefix-cache hits and decode, all through the Triton kernels."""
    prefix = random_prompts([40], seed=400)[0]
    prompts = [prefix + t for t in random_prompts([1, 9, 30, 57], seed=401)] + random_prompts([3, 70], seed=402)
    run = run_factory(tiny_model, attention_backend="triton", max_num_batched_tokens=32, device=DEVICE.type,
                      dtype="float32")
    check_against_hf(run, hf_oracle, prompts, max_new=12)
    check_against_hf(run, hf_oracle, prompts, max_new=12)  # now the shared prefix comes from the cache
    assert run.llm.engine.stats.prefix_cache_hit_tokens >= 32 * len(prompts)


# -- the decode CUDA-graph path, replayed eagerly on the CPU ---------------------------------------------
class EagerGraph:
    """Stands in for a captured CUDA graph: a replay runs the captured body again into the same output."""

    def __init__(self, run, output):
        self.run, self.output = run, output

    def replay(self):
        self.output.copy_(self.run())

    def reset(self):
        pass


def eager_decode_graphs(runner, sample_in_graph):
    from llmcli.engine.cuda_graphs import DecodeGraphs

    class EagerDecodeGraphs(DecodeGraphs):
        def _capture(self, bs, body, pool):
            output = body(bs)

            def run():  # a real graph has its metadata baked in; the eager body reads the backend's
                self.backend.prepare_for_capture(bs)
                return body(bs)
            return EagerGraph(run, output), output, None

    return EagerDecodeGraphs(runner.model, runner.backend, runner.config, runner.device, sample_in_graph,
                             groups=len(runner.rows.group_tables))


@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
@pytest.mark.parametrize("sample_in_graph,table_copy", [(False, False), (True, False), (True, True)])
def test_decode_graph_path_matches_hf(tiny_model, hf_oracle, run_factory, monkeypatch, sample_in_graph, table_copy):
    """Staged inputs, in-flight tokens taken inside the graph, padding rows, block tables gathered on the
    device, and (sample_in_graph) the lm_head and one-pass sampler in the graph: HF's greedy tokens.
    ``table_copy``: the block tables' separate device copy, as on CUDA, whose deltas ride in the staged copy.
    Every decode launch gets a launch order that is a permutation of the graph's rows, longest context first."""
    from llmcli.engine.block_tables import BlockTables
    from llmcli.kernels import triton_backend

    launch = triton_backend.paged_decode
    orders: list[list[int]] = []

    def check_order(q, k_cache, v_cache, tables, lens, *args, row_order=None, **kw):
        if row_order is not None and k_cache.numel():  # (capture's warm-up runs before any row is real)
            order, lengths = row_order.tolist(), lens.tolist()
            assert sorted(order) == list(range(len(lengths))), order
            assert [lengths[i] for i in order] == sorted(lengths, reverse=True), (order, lengths)
            orders.append(order)
        return launch(q, k_cache, v_cache, tables, lens, *args, row_order=row_order, **kw)

    monkeypatch.setattr(triton_backend, "paged_decode", check_order)

    run = run_factory(tiny_model, attention_backend="triton", device=DEVICE.type, dtype="float32", max_num_seqs=4,
                      max_num_batched_tokens=64)
    runner = run.llm.engine.model_runner
    if table_copy:
        old = runner.block_tables
        runner.rows.block_tables = BlockTables(old.width, old.block_size, DEVICE, rows=old.host.shape[0], copy=True)
    runner.graphs = eager_decode_graphs(runner, sample_in_graph)
    assert runner.graphs.batch_sizes == [1, 2, 4]
    prompts = random_prompts([45, 9, 30], seed=405)  # 3 rows in the graph of 4; blocks of 16 fill up on the way
    check_against_hf(run, hf_oracle, prompts, max_new=8)
    assert run.llm.engine.step_timer.steps["decode"] >= 7
    assert any(o[:3] != [0, 1, 2] for o in orders), "the rows' lengths differ: some launch must reorder them"
    assert any(len(o) == 4 and o[3] == 3 for o in orders), "the graph's padding row (length 0) launches last"



@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_gated_delta.py covers CUDA")
def test_decode_graph_path_carries_linear_attention_state(tiny_checkpoint, hf_oracle, run_factory):
    """A hybrid model (Qwen3.5) through the decode graphs: each row's state slot is its block-table row from
    the staged inputs, the padding row's (-1) the scratch slot, which no real sequence ever reads."""
    model = tiny_checkpoint("qwen3.5")
    run = run_factory(model, attention_backend="triton", device=DEVICE.type, dtype="float32", max_num_seqs=4,
                      max_num_batched_tokens=64)
    runner = run.llm.engine.model_runner
    runner.graphs = eager_decode_graphs(runner, False)
    prompts = random_prompts([45, 9, 30], seed=406)  # 3 rows in the graph of 4
    check_against_hf(run, hf_oracle, prompts, max_new=8)
    assert run.llm.engine.step_timer.steps["decode"] >= 7


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
@pytest.mark.parametrize("family", ["gemma3"])
def test_decode_graph_path_reads_each_kv_groups_tables(family, tiny_checkpoint, hf_oracle, run_factory):
    """Sliding-window KV groups (engine/kv_groups.py) through the decode graphs: each group's slots staged with
    the other inputs, each group's block tables gathered from its own device copy (as on CUDA; the first
    group's deltas ride in the staged copy, the others' go on their own), and blocks that fell out of the
    window handed to other rows in a small pool: HF's greedy tokens."""
    from llmcli.engine.block_tables import BlockTables

    model = tiny_checkpoint(family)
    run = run_factory(model, attention_backend="triton", device=DEVICE.type, dtype="float32", max_num_seqs=4,
                      max_num_batched_tokens=64, num_kvcache_blocks=24)
    runner = run.llm.engine.model_runner
    rows = runner.rows
    rows.group_tables = [BlockTables(t.width, t.block_size, DEVICE, rows=t.host.shape[0], copy=True)
                         for t in rows.group_tables]
    assert len(rows.group_tables) == 3  # one full layer, two local layers: three groups of one layer
    runner.graphs = eager_decode_graphs(runner, False)
    prompts = random_prompts([40, 9, 20], seed=407)  # 3 rows in the graph of 4, all decoding past a window (24)
    check_against_hf(run, hf_oracle, prompts, max_new=16)
    assert run.llm.engine.step_timer.steps["decode"] >= 15


@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
@pytest.mark.parametrize("mixed_steps", [False, True])
def test_graph_step_after_a_step_wider_than_the_graphs(tiny_model, hf_oracle, run_factory, monkeypatch, mixed_steps):
    """max_num_seqs above the largest graph (as 1024 is above 512): a decode step that fits a graph right after
    a step that sampled more rows than the graphs hold (eager decode, or a mixed step) takes its in-flight tokens
    from that wider step (the graphs' token buffer holds max_num_seqs). Graphs of 1 and 2 rows here, 4
    sequences: HF's greedy tokens, no crash."""
    from llmcli.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "graph_batch_sizes", lambda max_num_seqs, spacing=None: [1, 2])
    run = run_factory(tiny_model, attention_backend="triton", device=DEVICE.type, dtype="float32", max_num_seqs=4,
                      max_num_batched_tokens=48, mixed_steps=mixed_steps)
    runner = run.llm.engine.model_runner
    runner.graphs = eager_decode_graphs(runner, sample_in_graph=False)
    assert runner.graphs.batch_sizes == [1, 2]
    prompts = random_prompts([40, 7, 23, 3], seed=407)  # chunked: the sequences start (and finish) apart
    check_against_hf(run, hf_oracle, prompts, max_new=8)



@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_carried_decode_arrays_are_the_ones_built_from_the_sequences(tiny_model, hf_oracle, run_factory, monkeypatch,
                                                                     prefix_caching):
    """A decode plan over the same sequences as the one before (``StepPlan.follows``) takes its arrays from
    that plan's instead of reading every sequence: at every step where it does, they must be exactly what
    the sequences say, with every new block already in a plan, through blocks filling up, preemption (a pool
    of 12 blocks of 16 for 8 requests) and re-admission; and HF's tokens."""
    from llmcli.engine.plan_builder import PlanBuilder

    decode = PlanBuilder.decode
    carried: list[int] = []

    def decode_and_compare(self, seqs):
        plan = decode(self, seqs)
        if plan.follows:
            want = {"rows": [s.table_row for s in seqs], "computed": [len(s.token_ids) - 1 for s in seqs],
                    "pending": [s.pending_row for s in seqs], "scheduled": [1] * len(seqs),
                    "tokens": [0] * len(seqs)}  # every input token in flight
            for name, values in want.items():
                np.testing.assert_array_equal(getattr(plan, name), values, err_msg=name)
            assert all(self.sent[s.table_row] == len(s.block_table) for s in seqs), \
                "a block table grew without the plan carrying it"
            assert not plan.new_rows
            carried.append(len(seqs))
        return plan

    monkeypatch.setattr(PlanBuilder, "decode", decode_and_compare)
    run = run_factory(tiny_model, attention_backend="triton", device=DEVICE.type, dtype="float32", max_num_seqs=8,
                      kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192, max_num_batched_tokens=192,
                      enable_prefix_caching=prefix_caching)
    runner = run.llm.engine.model_runner
    runner.graphs = eager_decode_graphs(runner, sample_in_graph=True)
    prompts = random_prompts([20, 33, 40, 47, 60, 70, 90, 110], seed=300)
    check_against_hf(run, hf_oracle, prompts, max_new=24)
    assert run.llm.engine.stats.num_preemptions > 0, "the tiny KV pool should have forced preemption"
    assert len(carried) >= 20 and len(set(carried)) > 1, carried  # carried at several batch sizes


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_qk_transform_and_store_give_the_separate_kernels_logits(tiny_checkpoint, hf_oracle, run_factory,
                                                                        monkeypatch, family):
    """The triton backend's one kernel for q/k norm + rotary + KV store (llama: its rotary-only form, after the
    q/k/v bias, with llama3 rope scaling) against the q/k kernel and then store_kv,
    on the tiny model through chunked prefill, mixed steps, prefix-cache hits and decode (through the graph
    buffers, padding rows included): the same logits at every step, bit for bit. CPU: the interpreter in float32
    with the fusion forced on (the layers run eager on CPU otherwise) and HF's greedy tokens; GPU: bfloat16 with
    captured CUDA graphs, the fusion on by default."""
    from collections import Counter

    from llmcli import SamplingParams
    from llmcli.kernels import triton_backend

    calls: Counter = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(te, "qk_norm_rotary_store", counted("fused", te.qk_norm_rotary_store))
    monkeypatch.setattr(triton_backend, "store_kv", counted("store_kv", triton_backend.store_kv))
    monkeypatch.setattr("llmcli.layers.attention.qk_norm_rotary", counted("qk", te.qk_norm_rotary))
    prefix = random_prompts([32], seed=410)[0]
    prompts = [prefix + t for t in random_prompts([1, 12], seed=411)] + random_prompts([3, 30], seed=412)
    logits, tokens = {}, {}
    for fused in (False, True):
        monkeypatch.setattr("llmcli.layers.attention.triton_kernels_on", lambda t, on=fused: on)
        # a budget of 20 cuts the second prompt's chunk in the step where the first finishes its prompt, so the
        # first decodes beside the rest of it (a mixed step); 24 would fit all three prompts by then
        run = run_factory(tiny_checkpoint(family), attention_backend="triton", max_num_batched_tokens=20,
                          max_num_seqs=3, max_model_len=64, mixed_steps=True, sample_in_graph=False, device=DEVICE.type,
                          dtype="bfloat16" if ON_GPU else "float32")
        runner = run.llm.engine.model_runner
        if not ON_GPU:
            runner.graphs = eager_decode_graphs(runner, False)
        compute, seen = runner.model.compute_logits, []

        def recorded(hidden, compute=compute, seen=seen):
            seen.append(compute(hidden).clone())
            return seen[-1]

        monkeypatch.setattr(runner.model, "compute_logits", recorded)
        calls.clear()
        tokens[fused] = []
        for _ in range(2):  # the second time round, the shared prefix comes from the cache
            if ON_GPU:
                outs = run.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            else:
                outs = check_against_hf(run, hf_oracle, prompts, max_new=6)
            tokens[fused] += [list(o["token_ids"]) for o in outs]
        logits[fused] = seen
        assert run.llm.engine.step_timer.steps.get("mixed", 0) > 0 and run.llm.engine.step_timer.steps["decode"] > 0
        assert run.llm.engine.stats.prefix_cache_hit_tokens >= 32 * 2
        if fused:
            assert calls["fused"] > 0 and calls["store_kv"] == 0 and calls["qk"] == 0, calls
        else:
            assert calls["fused"] == 0 and calls["store_kv"] > 0 and calls["qk"] > 0, calls
    assert tokens[True] == tokens[False]
    assert len(logits[True]) == len(logits[False]) > 0
    for step, (a, b) in enumerate(zip(logits[False], logits[True])):
        assert torch.equal(a, b), f"logits differ at step {step}"


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs; the GPU captures real ones")
def test_sampling_inside_the_decode_graph_draws_what_the_sampler_draws(tiny_model, run_factory):
    """Seeded temperature sampling: the graph's one-pass sampler gets the same seeds and steps as the sampler
    outside it, so the draws agree (up to a float32 near-tie now and then)."""
    from llmcli import SamplingParams

    prompts = random_prompts([45, 9, 30], seed=406)
    params = [SamplingParams(temperature=1.0, min_p=0.02, max_tokens=8, ignore_eos=True, seed=10 + i)
              for i in range(len(prompts))]
    outs = {}
    for in_graph in (False, True):
        run = run_factory(tiny_model, attention_backend="triton", device=DEVICE.type, dtype="float32",
                          max_num_seqs=4, max_num_batched_tokens=64)
        runner = run.llm.engine.model_runner
        runner.graphs = eager_decode_graphs(runner, in_graph)
        outs[in_graph] = [list(o["token_ids"]) for o in run.llm.generate(prompts, params)]
    same = sum(a == b for x, y in zip(outs[False], outs[True]) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in outs[False]), outs


class CountedReplays:
    """A sampler graph whose replays are counted (a real one on the GPU, the eager stand-in on the CPU)."""

    def __init__(self, graph, counts, key):
        self.graph, self.counts, self.key = graph, counts, key

    def replay(self):
        self.counts[self.key] += 1
        self.graph.replay()

    def reset(self):
        self.graph.reset()


@pytest.mark.gpu
def test_filtered_rows_sample_inside_the_decode_graph(tiny_model, run_factory, monkeypatch):
    """Top-k / top-p / min-p rows mixed with plain, greedy and greedy-with-top-k rows, through several decode
    steps (3 to 1 rows in graphs of 4, padding rows included, requests finishing apart): every graph step's
    tokens, sampled inside the graph, must be the eager sampler's (``sample_one_pass``: the draw the sampler
    runs outside the graph on CUDA) over the same logits with each request's own settings, seed and step;
    a step replays the filtered sampler graph exactly when some sampling row has top-k or top-p. On the GPU
    the graphs are captured for real (bfloat16); on the CPU the eager stand-in replays them."""
    from collections import Counter

    from llmcli import SamplingParams
    from llmcli.engine.model_runner import ModelRunner
    from llmcli.layers.sampler import sample_one_pass

    run = run_factory(tiny_model, attention_backend="triton", device=DEVICE.type,
                      dtype="bfloat16" if ON_GPU else "float32", max_num_seqs=4, max_num_batched_tokens=64)
    runner = run.llm.engine.model_runner
    if not ON_GPU:
        runner.graphs = eager_decode_graphs(runner, sample_in_graph=True)
    graphs = runner.graphs
    assert graphs.sample_in_graph, "the one-pass sampler failed its start-up check"
    replays: Counter = Counter()
    for key in list(graphs.samplers):
        graphs.samplers[key] = CountedReplays(graphs.samplers[key], replays, key[1])
    checked: list[tuple[int, bool]] = []
    launch_graph = ModelRunner._launch_graph

    def launch_and_check(self, plan):
        by_row = {s.table_row: s for s in run.llm.engine.scheduler.running}  # the plan's entries' requests
        seqs = [by_row[row] for row in plan.rows.tolist()]
        params = [s.params for s in seqs]
        settings = dict(temperatures=[p.temperature for p in params], top_ks=[p.top_k for p in params],
                        top_ps=[p.top_p for p in params], min_ps=[p.min_p for p in params],
                        seeds=[s.seed for s in seqs], steps=[s.num_completion_tokens for s in seqs])
        before = Counter(replays)
        launched = launch_graph(self, plan)
        n = len(seqs)
        bs = next(b for b in graphs.batch_sizes if b >= n)
        got = graphs.tokens[:n].clone()
        logits = self.model.compute_logits(graphs.outputs[bs])[:n]  # the graph's own lm_head shape
        t = {k: torch.tensor(v, device=DEVICE, dtype=torch.float32 if k in ("temperatures", "top_ps", "min_ps")
                             else torch.int64) for k, v in settings.items()}
        want = sample_one_pass(logits, t["temperatures"], t["top_ks"], t["top_ps"], t["min_ps"], t["seeds"],
                               t["steps"], True)
        assert got.tolist() == want.tolist(), (settings, got.tolist(), want.tolist())
        filtered = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        assert replays - before == Counter({filtered: 1}), (replays - before, filtered)
        checked.append((n, filtered))
        return launched

    monkeypatch.setattr(ModelRunner, "_launch_graph", launch_and_check)
    # (temperature, top_k, top_p, min_p, max_tokens): the filtered requests finish first, so that the last
    # steps are unfiltered ones (and one greedy request with top-k set, which needs no filter)
    kinds = [(0.8, 20, 0.95, 0.0, 5), (1.0, -1, 1.0, 0.0, 12), (0.0, 5, 1.0, 0.0, 9), (1.0, -1, 0.5, 0.05, 7),
             (0.7, 3, 1.0, 0.0, 4), (1.2, -1, 1.0, 0.1, 10)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=n, ignore_eos=True, seed=30 + i)
              for i, (t, k, p, m, n) in enumerate(kinds)]
    outs = run.llm.generate(random_prompts([45, 9, 30, 17, 5, 22], seed=408), params)
    assert [len(o["token_ids"]) for o in outs] == [k[-1] for k in kinds]
    assert {f for _, f in checked} == {False, True} and len({n for n, _ in checked}) > 1, checked


@pytest.mark.skipif(ON_GPU, reason="float32 Triton dots run as tf32 on the GPU; tests/test_gpu_e2e.py covers bf16 there")
def test_engine_mixed_steps_on_triton_backend_matches_hf(tiny_model, hf_oracle, run_factory):
    """Decode rows riding along with prompt chunks through the Triton paged prefill kernel."""
    prompts = random_prompts([3, 45, 20, 70, 9], seed=403)
    run = run_factory(tiny_model, attention_backend="triton", max_num_batched_tokens=24, max_num_seqs=3,
                      device=DEVICE.type, dtype="float32", mixed_steps=True)
    check_against_hf(run, hf_oracle, prompts, max_new=10)
    assert run.llm.engine.step_timer.steps.get("mixed", 0) > 0


def test_kernel_variant_warmup_stores_nothing(tiny_model, run_factory):
    """The start-up pass over every prefill/sampler variant (run on CUDA) must leave the KV pool untouched."""
    run = run_factory(tiny_model, attention_backend="triton", max_num_batched_tokens=4096, device=DEVICE.type,
                      dtype="float32", num_kvcache_blocks=256)
    runner = run.llm.engine.model_runner
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    compile_variants(runner)
    assert torch.equal(runner.kv_cache, before)


# --------------------------------------------------------------------------
# the one-pass sampler (no top-k/top-p) against the torch sampler
# --------------------------------------------------------------------------
@pytest.mark.parametrize("rows,vocab", [(1, 1000), (5, 3 * CHUNK + 17), (64, 151936 if ON_GPU else 2 * CHUNK),
                                       (2, 151936)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_one_pass_sampler_matches_torch_sampler(rows, vocab, dtype, monkeypatch):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)
    temps = torch.rand(rows, generator=g) * 1.5
    temps[::3] = 0.0  # greedy rows mixed in
    min_ps = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g) * 0.3, 0.0)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    temps, min_ps, seeds, steps = (t.to(DEVICE) for t in (temps, min_ps, seeds, steps))
    ours = sample_unfiltered(logits, temps, min_ps, row_keys(seeds, steps))
    monkeypatch.setenv("LLMCLI_EAGER", "1")  # the reference: the torch sampler as plain eager code
    ref = sample(logits, temps, None, None, min_ps, seeds, steps, False)
    monkeypatch.delenv("LLMCLI_EAGER")
    # every float operation is the same on both paths (products by 1/T, libdevice's log, nothing fused into an
    # FMA): the same token in every row, near-ties included (the GPU run of 2026-12-02 had row 26 of 64 at
    # vocab 151,936 differ: 19443 vs 94020)
    assert torch.equal(ours, ref), torch.nonzero(ours != ref).flatten().tolist()
    scaled = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    # greedy rows take the first maximum, as torch.argmax does
    greedy = temps == 0
    assert torch.equal(ours[greedy], logits[greedy].float().argmax(-1))
    # min-p: every sampled token keeps at least min_p of the top probability
    probs = torch.softmax(scaled, -1)
    kept = probs.gather(1, ours[:, None]).squeeze(1) >= min_ps * probs.amax(-1) * (1 - 1e-5)
    assert kept.all()


def test_one_pass_sampler_draws_follow_the_distribution():
    """1,000 draws from one row with fresh steps: token frequencies follow softmax(logits / T)."""
    vocab, n, temp = 10, 1000, 0.7
    logits = torch.linspace(-2.0, 2.0, vocab).to(DEVICE)
    rows = logits.expand(n, vocab).contiguous()
    steps = torch.arange(n).to(DEVICE)
    seeds = torch.full((n,), 1234).to(DEVICE)
    tokens = sample_unfiltered(rows, torch.full((n,), temp).to(DEVICE), torch.zeros(n).to(DEVICE),
                               row_keys(seeds, steps))
    freq = torch.bincount(tokens.cpu(), minlength=vocab).float() / n
    want = torch.softmax(logits.cpu() / temp, -1)
    # total variation distance of the empirical distribution: ~0.04 expected at n=1000, 10 bins (the
    # interpreter runs one program per draw, so few draws over few bins; ignoring T would give ~0.12)
    assert 0.5 * (freq - want).abs().sum().item() < 0.08


# The hash, written out again here on Python ints/NumPy (not llmcli's), to build rows with chosen noise.
_M32, _MUL = 0xFFFFFFFF, 0x45D9F3B


def _hash32(x):
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _unhash32(x: int) -> int:
    inv = pow(_MUL, -1, 1 << 32)
    for _ in range(2):
        x = (x >> 16) ^ x
        x = (x * inv) & _M32
    return (x >> 16) ^ x


def _exact_gumbel(bits: np.ndarray) -> np.ndarray:
    """-log(-log u), u = (bits + 0.5) / 2**24, in float64 (log1p keeps it exact for u near 1)."""
    v = ((1 << 24) - bits - 0.5) / float(1 << 24)  # 1 - u, exact in float64
    return -np.log(-np.log1p(-v))


EXTREME_BITS = [(1 << 24) - 1, (1 << 24) - 2, (1 << 24) - 3, (1 << 24) - 8, (1 << 24) - 1000, 1 << 23, (1 << 23) - 1, 0]


@triton.jit
def gumbel_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(out_ptr + i, _gumbel(bits), mask=i < n)


def test_gumbel_noise_is_exact_up_to_the_largest_u():
    """The noise of every 24-bit value near u = 1, near u = 1/2 and near 0, in both implementations, against
    float64: the old float32 formula rounded the largest u to 1.0 (noise +inf) and its neighbours by up to 2x."""
    from llmcli.layers.sampler import gumbel_noise

    edges = [np.arange(0, 400), np.arange((1 << 23) - 400, (1 << 23) + 400), np.arange((1 << 24) - 1200, 1 << 24)]
    bits = np.concatenate(edges + [np.random.default_rng(7).integers(0, 1 << 24, 2000)])
    want = _exact_gumbel(bits)
    torch_noise = gumbel_noise(torch.from_numpy(bits).to(DEVICE)).cpu().double().numpy()
    triton_noise = torch.empty(len(bits), device=DEVICE)
    gumbel_kernel[(1,)](torch.from_numpy(bits).to(torch.int32).to(DEVICE), triton_noise, len(bits),
                        BLOCK=triton.next_power_of_2(len(bits)))
    for got in (torch_noise, triton_noise.cpu().double().numpy()):
        assert np.isfinite(got).all()
        err = np.abs(got - want)  # float32 noise is at most ~17.3: a few ulps there are ~4e-6 (the GPU's fast
        # log adds ~2**-22 of |log| more); the old formula was off by 0.29 and +inf at the largest u's
        assert err.max() < (2e-5 if ON_GPU else 8e-6), (bits[err.argmax()], got[err.argmax()], want[err.argmax()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_samplers_draw_the_exact_gumbel_max_where_u_is_largest(dtype, monkeypatch):
    """Rows whose seed gives a token with a poor logit the largest u's: both samplers must draw float64's
    Gumbel-max (the old formula gave that token +inf noise, so it won)."""
    vocab = 151936 if ON_GPU else 2 * CHUNK + 17
    g = torch.Generator().manual_seed(11)
    rows = len(EXTREME_BITS)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2).to(dtype)
    poor = torch.randint(0, vocab, (rows,), generator=g)
    poor[-1] = vocab - 1
    logits[torch.arange(rows), poor] = -30.0
    keys = [_unhash32(b << 8) ^ int(t) for b, t in zip(EXTREME_BITS, poor)]  # hash(key ^ t) >> 8 == b
    seeds = torch.tensor([_unhash32(_unhash32(k)) for k in keys])  # row key at step 0: hash(hash(seed))
    steps = torch.zeros(rows, dtype=torch.int64)
    assert row_keys(seeds, steps).tolist() == keys
    ids = np.arange(vocab, dtype=np.uint64)
    scores = np.stack([logits[r].double().numpy() + _exact_gumbel(_hash32(np.uint64(k) ^ ids) >> np.uint64(8))
                       for r, k in enumerate(keys)])
    order = np.argsort(-scores, axis=1)
    assert (order[:, 0] != poor.numpy()).all()  # the test's premise: the poor token cannot win honestly
    temps, min_ps = torch.ones(rows), torch.zeros(rows)
    on = [t.to(DEVICE) for t in (logits, temps, min_ps, seeds, steps)]
    ours = sample_unfiltered(on[0], on[1], on[2], row_keys(on[3], on[4])).cpu()
    monkeypatch.setenv("LLMCLI_EAGER", "1")
    ref = sample(on[0], on[1], None, None, on[2], on[3], on[4], False).cpu()
    for name, got in (("one-pass", ours), ("torch", ref)):
        for r in range(rows):
            top2 = scores[r, order[r, :2]]
            allowed = order[r, :2] if top2[0] - top2[1] < 1e-4 * abs(top2[0]) else order[r, :1]
            assert int(got[r]) in allowed.tolist(), f"{name} sampler, bits {EXTREME_BITS[r]}: drew {int(got[r])}"
from llmcli.kernels import triton_sample  # noqa: E402


def test_start_up_check_keeps_a_correct_one_pass_sampler_and_drops_a_wrong_one(monkeypatch):
    from llmcli.kernels import triton_sample
    from llmcli.layers.sampler import Sampler

    good = Sampler()
    assert good.check_one_pass(3000, DEVICE) is None and good.one_pass

    real = triton_sample.sample_unfiltered
    monkeypatch.setattr(triton_sample, "sample_unfiltered", lambda logits, *a: real(logits, *a) + 1)
    bad = Sampler()
    reason = bad.check_one_pass(3000, DEVICE)
    assert reason is not None and "torch sampler" in reason and not bad.one_pass


@triton.jit
def _gumbel_log_near_one(bits, ACCURATE: tl.constexpr = False):
    """The old noise: u near 1 rounds to 1.0 and gets +inf, like the GPU's fast log one step earlier."""
    return -tl.log(-tl.log((bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)))


@pytest.mark.skipif(ON_GPU, reason="swaps a jit function's global: works in the interpreter only")
def test_start_up_check_drops_a_one_pass_sampler_whose_noise_fails_near_u_1(monkeypatch):
    from llmcli.kernels import triton_sample
    from llmcli.layers.sampler import Sampler

    monkeypatch.setattr(triton_sample, "_gumbel", _gumbel_log_near_one)
    bad = Sampler()
    reason = bad.check_one_pass(3000, DEVICE)
    assert reason is not None and "torch sampler" in reason and not bad.one_pass


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_kernel_matches_log_softmax(dtype, k):
    """Against torch's float32 log_softmax: the target's logprob and rank, and the top k (values and ids).
    The vocab is not a multiple of the chunk, rows are a strided view, one row's top logits tie across
    chunks, and one target is the row's argmax (rank 1)."""
    vocab = 2 * triton_logprobs.CHUNK + 123
    full = (torch.randn(4, vocab + 7, device=DEVICE) * 3).to(dtype)
    full[2, 5] = full[2, triton_logprobs.CHUNK + 9] = full[2, vocab - 10] = 40  # a tie across chunks
    logits = full[:, :vocab]
    targets = torch.tensor([0, vocab - 1, 5, int(logits[3].float().argmax())], device=DEVICE)
    lp, ranks, ids, tops = triton_logprobs.token_logprobs_triton(logits, targets, k)
    ref = torch.log_softmax(logits.float(), dim=-1)
    chosen = ref.gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(lp, chosen, atol=1e-5, rtol=0)
    assert ranks.tolist() == ((ref > chosen[:, None]).sum(-1) + 1).tolist()
    assert ranks[3].item() == 1 and ranks[2].item() == 1
    want = ref.topk(k, dim=-1).values
    assert ids.shape == (4, k) and tops.shape == (4, k)
    assert torch.allclose(tops, want, atol=1e-5, rtol=0)
    assert torch.allclose(ref.gather(1, ids), want, atol=1e-5, rtol=0)  # the ids are the top tokens
    assert all(len(set(row)) == k for row in ids.tolist())
    if k >= 3:
        assert ids[2, :3].tolist() == [5, triton_logprobs.CHUNK + 9, vocab - 10]  # ties: lower id first


def test_one_pass_sampler_never_draws_a_masked_token_at_the_top_hash_value():
    """Seed 213, step 534: token 86015's hash is the largest 24-bit value (tests/test_sampling.py), whose
    uniform rounded to 1.0: infinite Gumbel noise, NaN on the masked token, which won the draw."""
    seed, step, token = 213, 534, 86015
    vocab = token + 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, token] = float("-inf")  # disallowed by a token bitmask
    temps, min_ps = torch.tensor([0.6, 0.6]), torch.tensor([0.0, 0.2])
    keys = row_keys(torch.tensor([seed, seed]), torch.tensor([step, step]))
    got = sample_unfiltered(logits.to(DEVICE), temps.to(DEVICE), min_ps.to(DEVICE), keys.to(DEVICE)).cpu()
    assert token not in got.tolist()
    ref = sample(logits, temps, None, None, min_ps, torch.tensor([seed, seed]), torch.tensor([step, step]), False)
    assert torch.equal(got, ref)
