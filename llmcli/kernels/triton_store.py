"""Triton kernel that writes each new token's K and V into the paged KV cache.

One program per token: it reads the token's flat slot, and copies the token's
``[num_kv_heads, head_dim]`` key and value rows into ``block = slot // block_size``,
``row = slot % block_size`` of the caches. Slot -1 (padding, or a token whose KV
must not be kept) writes nothing. The triton backend stores inside the q/k
norm + rotary kernel instead when the layer lets it (``triton_elementwise.qk_norm_rotary_store``);
this kernel serves the flash-attn backend and the triton backend's other paths.

An FP8 cache (``float8_e4m3fn``) gets ``value / scale`` saturated at +-448, as ``torch_backend.quantize_kv``
computes it (``to_cache``, which the fused store uses too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn


@triton.jit
def to_cache(x, scale, dst_ptr, FP8: tl.constexpr):
    """``x`` as a cache of ``dst_ptr``'s dtype holds it: FP8 divided by the layer's scale and saturated."""
    if FP8:
        y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX).to(dst_ptr.dtype.element_ty)
    else:
        y = x.to(dst_ptr.dtype.element_ty)
    return y


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HD: tl.constexpr, FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # All heads of one token at once: a flat [num_kv_heads * head_dim] vector,
    # padded to a power of two; slot -1 shrinks the valid length to 0.
    offs = tl.arange(0, BLOCK_HD)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = offs < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_DIM, 0)
    blk = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    tok64 = tok.to(tl.int64)
    k = tl.load(k_ptr + tok64 * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + tok64 * stride_vt + head * stride_vh + dim, mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + row * stride_kcs + head * stride_kch + dim
    v_dst = v_cache_ptr + blk * stride_vcb + row * stride_vcs + head * stride_vch + dim
    tl.store(k_dst, to_cache(k, k_scale, k_cache_ptr, FP8), mask=mask)
    tl.store(v_dst, to_cache(v, v_scale, v_cache_ptr, FP8), mask=mask)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Scatter ``k``/``v`` ([num_tokens, num_kv_heads, head_dim]) into the caches by ``slot_mapping``.

    ``k``/``v`` may be strided views (e.g. slices of a fused qkv projection) as long
    as their last dimension is contiguous; the caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous last dimension.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert slot_mapping.numel() == num_tokens, "one slot per token"
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    block_size = k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(kv_scales[0]), float(kv_scales[1]),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim), FP8=is_fp8(k_cache),
        num_warps=4,
    )
