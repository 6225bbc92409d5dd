"""The FP8 KV cache: the triton backend's kernels against the torch reference, and the engine's pool sizing.

Kernels run under Triton's interpreter on CPU (test_triton_kernels sets it up before any kernel module is
imported), in float32 and float16. Layer scales other than 1 (0.5 for k, 2 for v) and values past e4m3's range
check the division by the scale, the saturation at +-448 and the multiplication on every read.

The interpreter (triton 3.x) rounds float32 -> e4m3 wrongly where rounding up carries into the exponent (31.4
becomes 16, not 32), which the GPU's conversion does not. So on CPU the new keys and values are e4m3 values
times the scale (``new_kv``): the division is exact, saturation still happens, no rounding is exercised; on
the GPU they are plain random draws and the kernels must round exactly as torch does.
"""
from __future__ import annotations

import pytest
import torch

from test_triton_kernels import DEVICE, DTYPES, ON_GPU, TOL, make_case, nan_like, rel_err  # noqa: F401 (sets up the interpreter)

from llmcli.kernels import triton_elementwise as te
from llmcli.kernels.backend import AttentionMetadata
from llmcli.kernels.torch_backend import FP8_KV_DTYPE, TorchAttentionBackend, store_kv_torch
from llmcli.kernels.triton_backend import TritonAttentionBackend
from llmcli.kernels.triton_store import store_kv
from llmcli.layers.rotary import RotaryEmbedding, qk_norm_rotary

SCALES = (0.5, 2.0)
FP8_TOL = 2e-2  # both sides read the same e4m3 values; the rest is the dtype's own rounding (and bf16 widening)


def new_kv(shape, dtype, scale: float, spread: float = 1.0) -> torch.Tensor:
    """New k or v rows: random, or on CPU random e4m3 values times ``scale`` (see the module docstring); ``spread``
    widens them past e4m3's range."""
    x = torch.randn(shape, device=DEVICE) * spread
    if not ON_GPU:
        x = (x / scale).clamp(-448 * 4, 448 * 4)
        x = torch.where(x.abs() > 448, x.sign() * 1024, x.to(FP8_KV_DTYPE).float()) * scale
    return x.to(dtype)


def fp8_cache(ctx_lens, q_lens, num_kv_heads, head_dim, block_size):
    k_cache, v_cache, tables, slots = make_case(ctx_lens, q_lens, num_kv_heads, head_dim, block_size, torch.float32)
    return k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE), tables, slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_store_divides_and_saturates_like_torch(dtype):
    k_cache, v_cache, _, _ = fp8_cache([64], [0], 2, 64, 16)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEVICE)[:20]
    slots[3] = -1
    k = new_kv((20, 2, 64), dtype, SCALES[0], spread=100)
    v = new_kv((20, 2, 64), dtype, SCALES[1], spread=2000)  # / 2 still far past 448 in places
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(k, v, ref_k, ref_v, slots, SCALES)
    store_kv(k, v, k_cache, v_cache, slots, SCALES)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    flat_v = ref_v.view(-1, 2, 64)[slots[slots >= 0]].float()
    assert not flat_v.isnan().any() and flat_v.abs().max() == 448  # saturated, not NaN
    # stored = value / scale: read back times the scale it is within e4m3's rounding (3 mantissa bits)
    flat_k = ref_k.view(-1, 2, 64)[slots[slots >= 0]].float() * SCALES[0]
    kept = k[slots >= 0].float()
    in_range = kept.abs() <= 448 * SCALES[0]
    assert torch.allclose(flat_k[in_range], kept[in_range], rtol=2 ** -4, atol=2 ** -9 * SCALES[0])
    assert (flat_k[~in_range].abs() == 448 * SCALES[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if not ON_GPU else [torch.float16])
def test_fp8_fused_qk_norm_rotary_store_matches_store_kv(dtype):
    """The fused store writes the bytes ``store_kv`` writes for the rotated k (the same ``to_cache``), and on the
    GPU those of torch (on CPU the rotated keys are arbitrary floats, which the interpreter rounds wrongly)."""
    m, hq, hk, d = 9, 4, 2, 64
    q = torch.randn(m, hq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(m, hk, d, dtype=dtype, device=DEVICE)
    v = new_kv((m, hk, d), dtype, SCALES[1], spread=500)
    qw, kw = torch.rand(d, dtype=dtype, device=DEVICE) + 0.5, torch.rand(d, dtype=dtype, device=DEVICE) + 0.5
    positions = torch.randint(0, 100, (m,), device=DEVICE)
    rotary = RotaryEmbedding(d, 128, 10000.0)
    k_cache, v_cache, _, _ = fp8_cache([48], [0], hk, d, 16)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEVICE)[:m]
    slots[0] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    _, k_rot = qk_norm_rotary(q, k, positions, qw, kw, 1e-6, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE))
    (store_kv_torch if ON_GPU else store_kv)(k_rot, v, ref_k, ref_v, slots, SCALES)
    te.qk_norm_rotary_store(q, k, v, positions, qw, kw, 1e-6, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                            k_cache, v_cache, slots, kv_scales=SCALES)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def run_both(meta, q, k, v, k_cache, v_cache, num_splits=None):
    """The torch and triton backends on the same step, each with its own copy of the FP8 cache."""
    num_heads, num_kv_heads, head_dim, block_size = q.shape[1], k.shape[1], q.shape[2], k_cache.shape[1]
    outs, caches = [], []
    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        backend = cls(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, block_size)
        if num_splits is not None and cls is TritonAttentionBackend:
            backend.force_num_splits = num_splits
        backend.prepare(meta)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, kv_scales=SCALES))
        caches.append((kc, vc))
    return outs, caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_matches_torch(dtype, num_splits):
    lens = [1, 17, 64, 130, 0]
    k_cache, v_cache, tables, slots = fp8_cache(lens, [1] * len(lens), 2, 64, 16)
    q = torch.randn(len(lens), 8, 64, dtype=dtype, device=DEVICE)
    k = new_kv((len(lens), 2, 64), dtype, SCALES[0])
    v = new_kv((len(lens), 2, 64), dtype, SCALES[1])
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots,
                             context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                             block_tables=tables, max_seqlen_k=max(lens))
    (ref, out), ((rk, rv), (ok, ov)) = run_both(meta, q, k, v, k_cache, v_cache, num_splits)
    assert torch.equal(ok.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(ov.view(torch.uint8), rv.view(torch.uint8))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= FP8_TOL


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_prefill_with_prefix_and_mixed_step_match_torch(dtype):
    """Chunks over a cached FP8 prefix (prefix hit / chunked prefill), and a mixed step's decode rows."""
    prefix, q_lens = [0, 40, 16, 5, 70], [1, 1, 24, 9, 33]  # the first two: a mixed step's decode rows
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k_cache, v_cache, tables, slots = fp8_cache(ctx, q_lens, 2, 64, 16)
    total = sum(q_lens)
    q = torch.randn(total, 4, 64, dtype=dtype, device=DEVICE)
    k = new_kv((total, 2, 64), dtype, SCALES[0])
    v = new_kv((total, 2, 64), dtype, SCALES[1])
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(ctx).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    for num_decode in (0, 2):
        rest = q_lens[num_decode:]
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                                 block_tables=tables, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=max(q_lens),
                                 max_seqlen_k=max(ctx), has_prefix=True, num_decode=num_decode,
                                 rest_max_seqlen_q=max(rest), rest_has_prefix=True)
        (ref, out), _ = run_both(meta, q, k, v, k_cache, v_cache)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= FP8_TOL, num_decode


def test_fp8_activation_quant_kernel_matches_torch():
    """kernels/triton_fp8_quant.py against the torch ops of ``quantize_per_token`` (the CPU path): the same
    per-row scales and bytes. On CPU the rows are e4m3 values times a power of two with 448 in each (the
    interpreter's rounding caveat of the module docstring), so the division is exact."""
    from llmcli.kernels.triton_fp8_quant import quantize_rows
    from llmcli.layers.quantization.fp8 import quantize_per_token

    x = torch.randn(5, 300, device=DEVICE) * 30
    if not ON_GPU:
        x = x.clamp(-440, 440).to(FP8_KV_DTYPE).float()
        x[:, 7] = 448.0
        x = x * torch.tensor([0.25, 1.0, 4.0, 2.0 ** -6, 8.0], device=DEVICE)[:, None]
    x[3] = 0.0  # an all-zero row: a tiny scale, zeros
    q, s = quantize_rows(x)
    ref_q, ref_s = quantize_per_token(x.cpu())
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
