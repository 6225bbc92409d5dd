"""Hand-written Triton kernels for the model's elementwise work: RMSNorm (with the residual add), the gated
RMSNorm of Gated DeltaNet layers (``gated_rms_norm``), SiLU-and-mul,
and the rotary embedding, with Qwen3's per-head q/k RMSNorm before it or not (Llama, Qwen2, Mistral), optionally
with the KV-cache store too
(``qk_norm_rotary_store``: the triton attention backend's one kernel per layer for what ``qk_norm_rotary`` and
``triton_store.store_kv`` did in two; a compile-time switch of the same kernel, so q/k are the same bits).

Each kernel is specialised on its feature sizes (hidden size, intermediate size, heads, head_dim) as constexprs,
so that it compiles to straight-line vectorised code once per model, and takes the token count M at run time
(no specialisation on it): any batch works, inside CUDA graphs too (no host syncs; outputs come from
``torch.empty``). Every kernel rounds to the tensors' dtype exactly where the eager torch code in
``llmcli.layers`` does (a bfloat16 add, the norm in float32 then ``.to(dtype)`` then times the weight, each
rotary product rounded, ...), so greedy outputs stay as close to transformers as the eager code keeps them.
The signatures are the eager functions' own, so the layers can dispatch to them one for one.

Every launch passes ``enable_fp_fusion=False``. LLVM narrows ``(a.to(f32) * b.to(f32)).to(bf16)`` to a native bf16
multiply (exact, so harmless), but with Triton's default FP fusion the NVPTX backend then contracts that multiply
and the following add into one ``fma.rn.bf16x2``, dropping the product's rounding that the source spells out:
the rotary sums came out a bf16 ulp off eager in ~21% of elements on an H200. Eager torch never fuses across ops,
so no kernel here may either (tests/test_triton_elementwise.py checks the sm_90 PTX has no ``fma``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from llmcli.kernels.backend import rotary_width
from llmcli.kernels.triton_store import is_fp8, to_cache

# Rows of an RMSNorm handled by one program: enough elements per program for wide loads and few programs.
_NORM_ELEMENTS = 2048
# Columns of SiLU-and-mul per program.
_SILU_BLOCK = 1024
# Compile option for every launch: no mul+add contraction into FMAs across the roundings (module docstring).
_UNFUSED = {"enable_fp_fusion": False}


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, M, x_stride, res_stride, out_stride,
                     res_out_stride, eps, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        # x + residual in the tensors' dtype, as the eager code adds; this sum is also the new residual
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * res_out_stride + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) * (1.0 / N) + eps)  # torch's mean: the sum times 1/N
    normed = (xf * rstd[:, None]).to(x.dtype)  # .to(dtype) before the weight, as the eager code rounds
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim] with unit stride along the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_norm(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 res_out: torch.Tensor | None, eps: float) -> None:
    m, n = x2.shape
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(_NORM_ELEMENTS // block_n, 16))
    has_res = res2 is not None
    _rms_norm_kernel[(triton.cdiv(m, rows),)](
        x2, res2 if has_res else x2, weight, out, res_out if has_res else out, m, x2.stride(0),
        res2.stride(0) if has_res else 0, out.stride(0), res_out.stride(0) if has_res else 0, eps,
        N=n, BLOCK_N=block_n, ROWS=rows, HAS_RESIDUAL=has_res, num_warps=8 if block_n >= 4096 else 4,
        **_UNFUSED)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dimension."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _launch_norm(x2, None, weight, out, None, eps)
    return out.view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(x + residual), x + residual)``, the sum in the tensors' dtype."""
    x2, r2 = _rows(x), _rows(residual)
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    res_out = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _launch_norm(x2, r2, weight, out, res_out, eps)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit(do_not_specialize=["M"])
def _silu_and_mul_kernel(x_ptr, out_ptr, M, x_stride, out_stride, N: tl.constexpr, BLOCK: tl.constexpr,
                         LIBDEVICE_EXP: tl.constexpr):
    blocks_per_row = (N + BLOCK - 1) // BLOCK  # constexpr arithmetic: folded at compile time
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's CUDA silu: x / (1 + expf(-x)), an IEEE division; tl.exp and / would be the approximate ex2.approx
    # and div.full, a few float32 ulps off, enough to flip the bfloat16 rounding now and then
    e = libdevice.exp(-g) if LIBDEVICE_EXP else tl.exp(-g)
    act = tl.div_rn(g, 1.0 + e).to(gate.dtype)  # F.silu rounds to the dtype before the product
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


# libdevice's expf, as torch's CUDA silu calls it, in compiled kernels; Triton's interpreter (TRITON_INTERPRET,
# the CPU tests) has no libdevice.
_LIBDEVICE_EXP = isinstance(_silu_and_mul_kernel, triton.runtime.jit.JITFunction)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x`` is ``[..., 2I]`` = ``cat(gate, up)``."""
    x2 = _rows(x)
    m, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = min(_SILU_BLOCK, triton.next_power_of_2(n))
    if m:
        _silu_and_mul_kernel[(m * triton.cdiv(n, block),)](x2, out, m, x2.stride(0), out.stride(0), N=n,
                                                           BLOCK=block, LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=4,
                                                           **_UNFUSED)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _norm_rotate_heads(src_ptr, dst_ptr, w_ptr, src_row, dst_row, src_head_stride, c1, c2, s1, s2, eps, w_offset,
                       H: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, NORM: tl.constexpr,
                       OFFSET: tl.constexpr):
    """RMSNorm (``NORM``; without it ``w_ptr`` is never read) then rotary of one token's ``H`` heads: the first
    ``ROT`` dims rotated, their two halves kept apart (rotate-half), the other ``HEAD_DIM - ROT`` (partial rotary)
    only normed. ``OFFSET``: the zero-centred norm, ``x / rms(x) * (w_offset + w)`` in float32, rounded once.
    Stores them at ``dst_row`` and returns the rotated halves and the pass-through part (the first half again
    when there is none), rounded to the output dtype."""
    HALF = ROT // 2
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < H) & (dims[None, :] < HALF)
    first_ptrs = src_ptr + src_row + heads[:, None] * src_head_stride + dims[None, :]
    x1 = tl.load(first_ptrs, mask=mask, other=0.0)
    x2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    out_dtype = dst_ptr.dtype.element_ty
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    pdims = tl.arange(0, BLOCK_PASS)
    pmask = (heads[:, None] < H) & (pdims[None, :] < PASS)
    if PASS > 0:
        fp = tl.load(src_ptr + src_row + heads[:, None] * src_head_stride + ROT + pdims[None, :], mask=pmask,
                     other=0.0).to(tl.float32)
    else:
        fp = f1  # unused
    if NORM:
        sq = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
        if PASS > 0:
            sq += tl.sum(fp * fp, axis=1)
        rstd = tl.math.rsqrt(sq * (1.0 / HEAD_DIM) + eps)[:, None]
        dmask = dims < HALF
        w1 = tl.load(w_ptr + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if OFFSET:  # (x / rms(x)) * (offset + w) in float32, as transformers' zero-centred norms, then rounded
            n1 = (f1 * rstd * (w1 + w_offset)).to(out_dtype).to(tl.float32)
            n2 = (f2 * rstd * (w2 + w_offset)).to(out_dtype).to(tl.float32)
        else:
            # the norm as rms_norm rounds it; then every rotary product and the sum in the (normed) dtype (this
            # is where FP fusion would turn a product and the sum into one fma: the launch turns it off)
            n1 = ((f1 * rstd).to(dtype).to(tl.float32) * w1).to(out_dtype).to(tl.float32)
            n2 = ((f2 * rstd).to(dtype).to(tl.float32) * w2).to(out_dtype).to(tl.float32)
        if PASS > 0:
            wp = tl.load(w_ptr + ROT + pdims, mask=pdims < PASS, other=0.0).to(tl.float32)[None, :]
            if OFFSET:
                n_pass = (fp * rstd * (wp + w_offset)).to(out_dtype)
            else:
                n_pass = ((fp * rstd).to(dtype).to(tl.float32) * wp).to(out_dtype)
        else:
            n_pass = n1
    else:  # rotary only (Llama, Qwen2, Mistral): the inputs are already in the output dtype
        n1, n2 = f1, f2
        n_pass = fp.to(out_dtype)
    o1 = ((n1 * c1).to(out_dtype).to(tl.float32) + (-n2 * s1).to(out_dtype).to(tl.float32)).to(out_dtype)
    o2 = ((n2 * c2).to(out_dtype).to(tl.float32) + (n1 * s2).to(out_dtype).to(tl.float32)).to(out_dtype)
    out_ptrs = dst_ptr + dst_row + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptrs, o1, mask=mask)
    tl.store(out_ptrs + HALF, o2, mask=mask)
    if PASS > 0:
        tl.store(dst_ptr + dst_row + heads[:, None] * HEAD_DIM + ROT + pdims[None, :], n_pass, mask=pmask)
    return o1, o2, n_pass


@triton.jit(do_not_specialize=["M"])
def _qk_norm_rotary_kernel(q_ptr, k_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, M,
                           q_stride, q_head_stride, k_stride, k_head_stride, cos_stride, sin_stride, eps,
                           v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, v_stride, v_head_stride, kc_block_stride,
                           kc_row_stride, kc_head_stride, vc_block_stride, vc_row_stride, vc_head_stride,
                           k_scale, v_scale,
                           HQ: tl.constexpr, BLOCK_HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HK: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, ROT: tl.constexpr,
                           BLOCK_RHALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                           OFFSET: tl.constexpr,
                           FP8: tl.constexpr = False, w_offset=0.0):
    # ROT: the rotated dims (HEAD_DIM, or fewer with partial rotary); BLOCK_RHALF covers half of them, BLOCK_HALF
    # half the head (v's store), BLOCK_PASS the rest of the head
    RHALF = ROT // 2
    HALF = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    rdims = tl.arange(0, BLOCK_RHALF)
    rmask = rdims < RHALF
    out_dtype = q_out_ptr.dtype.element_ty
    # cos/sin rounded to the dtype first (``cos_table[positions].to(q.dtype)``), shared by q's and k's heads
    cos_row, sin_row = cos_ptr + pos * cos_stride, sin_ptr + pos * sin_stride
    c1 = tl.load(cos_row + rdims, mask=rmask, other=0.0).to(out_dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + RHALF + rdims, mask=rmask, other=0.0).to(out_dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + rdims, mask=rmask, other=0.0).to(out_dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + RHALF + rdims, mask=rmask, other=0.0).to(out_dtype).to(tl.float32)[None, :]
    _norm_rotate_heads(q_ptr, q_out_ptr, qw_ptr, token * q_stride, token * (HQ * HEAD_DIM), q_head_stride,
                       c1, c2, s1, s2, eps, w_offset, HQ, BLOCK_HQ, HEAD_DIM, ROT, BLOCK_RHALF, PASS, BLOCK_PASS, NORM,
                       OFFSET)
    k1, k2, kp = _norm_rotate_heads(k_ptr, k_out_ptr, kw_ptr, token * k_stride, token * (HK * HEAD_DIM),
                                    k_head_stride, c1, c2, s1, s2, eps, w_offset, HK, BLOCK_HK, HEAD_DIM, ROT,
                                    BLOCK_RHALF, PASS, BLOCK_PASS, NORM, OFFSET)
    if STORE:  # what store_kv does with the rotated k and v: both into row ``slot`` of the paged caches
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_HK)
        live = heads[:, None] < tl.where(slot >= 0, HK, 0)  # slot -1: stores nothing
        blk = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        k_dst = k_cache_ptr + blk * kc_block_stride + row * kc_row_stride + heads[:, None] * kc_head_stride
        kmask = live & (rdims[None, :] < RHALF)
        tl.store(k_dst + rdims[None, :], to_cache(k1, k_scale, k_cache_ptr, FP8), mask=kmask)
        tl.store(k_dst + RHALF + rdims[None, :], to_cache(k2, k_scale, k_cache_ptr, FP8), mask=kmask)
        if PASS > 0:
            pdims = tl.arange(0, BLOCK_PASS)
            tl.store(k_dst + ROT + pdims[None, :], to_cache(kp, k_scale, k_cache_ptr, FP8),
                     mask=live & (pdims[None, :] < PASS))
        dims = tl.arange(0, BLOCK_HALF)
        mask = live & (dims[None, :] < HALF)
        v_src = v_ptr + token * v_stride + heads[:, None] * v_head_stride + dims[None, :]
        v_dst = (v_cache_ptr + blk * vc_block_stride + row * vc_row_stride + heads[:, None] * vc_head_stride
                 + dims[None, :])
        tl.store(v_dst, to_cache(tl.load(v_src, mask=mask), v_scale, v_cache_ptr, FP8), mask=mask)
        tl.store(v_dst + HALF, to_cache(tl.load(v_src + HALF, mask=mask), v_scale, v_cache_ptr, FP8), mask=mask)


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, H, D] with each head contiguous (a view when it already is)."""
    return x if x.stride(2) == 1 else x.contiguous()


def _launch_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
               kv_scales: tuple[float, float] = (1.0, 1.0), rotary_dim: int | None = None,
               weight_offset: float = 0.0):
    m, hq, d = q.shape
    hk = k.shape[1]
    rot = rotary_width(d, cos, rotary_dim)
    q, k = _head_rows(q), _head_rows(k)
    norm = q_weight is not None
    offset = norm and weight_offset != 0.0
    if not norm:  # rotary only: NORM=False compiles the weight loads away, any tensor will do
        q_weight, k_weight = q, k
    # the zero-centred norm rounds to x's dtype (transformers' ``type_as(x)``), the other to the promoted one
    q_dtype = q.dtype if offset else torch.promote_types(q.dtype, q_weight.dtype)
    k_dtype = k.dtype if offset else torch.promote_types(k.dtype, k_weight.dtype)
    if q_dtype != k_dtype or q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype (got {q.dtype}/{q_weight.dtype} and {k.dtype}/{k_weight.dtype})")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the cos/sin tables must be contiguous along the head dimension")
    q_out = torch.empty((m, hq, d), dtype=q_dtype, device=q.device)
    k_out = torch.empty((m, hk, d), dtype=k_dtype, device=k.device)
    if not m:
        return q_out, k_out
    if store is None:  # the cache arguments are unused (STORE=False compiles them away): any tensor will do
        v, k_cache, v_cache, slots = k, k, k, positions
        cache_strides = (0,) * 6
        v_strides, block_size = (0, 0), 1
    else:
        v, k_cache, v_cache, slots = store
        v = _head_rows(v)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("the KV caches must be contiguous along the head dimension")
        if slots.numel() != m:
            raise ValueError(f"{slots.numel()} cache slots for {m} tokens: one slot per token")
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
        v_strides, block_size = (v.stride(0), v.stride(1)), k_cache.shape[1]
    _qk_norm_rotary_kernel[(m,)](
        q, k, positions, q_weight, k_weight, cos, sin, q_out, k_out, m, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos.stride(0), sin.stride(0), eps, v, slots, k_cache, v_cache, *v_strides, *cache_strides,
        float(kv_scales[0]), float(kv_scales[1]),
        HQ=hq, BLOCK_HQ=triton.next_power_of_2(hq), HK=hk, BLOCK_HK=triton.next_power_of_2(hk), HEAD_DIM=d,
        BLOCK_HALF=triton.next_power_of_2(d // 2), STORE=store is not None, BLOCK_SIZE=block_size, NORM=norm,
        ROT=rot, BLOCK_RHALF=triton.next_power_of_2(rot // 2), PASS=d - rot,
        BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)),
        OFFSET=offset, FP8=is_fp8(k_cache), w_offset=float(weight_offset), num_warps=4, **_UNFUSED)
    return q_out, k_out


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dim: int | None = None, weight_offset: float = 0.0):
    """Per-head RMSNorm of ``q`` [M, Hq, D] and ``k`` [M, Hk, D] (none when the weights are None), then neox-style
    rotary at ``positions`` on the first ``rotary_dim`` dims of each head.

    ``q`` and ``k`` may be strided views (of the fused qkv projection) as long as each head is contiguous;
    the results are new contiguous tensors. ``cos``/``sin`` are the [max_position, rotary_dim] tables
    (``rotary_dim`` None: their width). ``weight_offset`` != 0: the zero-centred norm
    (``layers.rotary.qk_norm_rotary``)."""
    return _launch_qk(q, k, positions, q_weight, k_weight, eps, cos, sin, None, rotary_dim=rotary_dim,
                      weight_offset=weight_offset)


def qk_norm_rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0),
                         rotary_dim: int | None = None, weight_offset: float = 0.0):
    """``qk_norm_rotary`` and then ``triton_store.store_kv(k_out, v, k_cache, v_cache, slot_mapping)``, in one kernel.

    The same q/k values as ``qk_norm_rotary`` (the same code computes them) and the same cache contents as the
    store: the rotated k and the untouched ``v`` [M, Hk, D] go to flat slot ``slot_mapping[i]`` of the
    ``[num_blocks, block_size, Hk, D]`` caches, nothing where the slot is -1 (an FP8 cache: divided by
    ``kv_scales`` and saturated, as ``store_kv``). Returns ``(q_out, k_out)``."""
    return _launch_qk(q, k, positions, q_weight, k_weight, eps, cos, sin, (v, k_cache, v_cache, slot_mapping),
                      kv_scales, rotary_dim, weight_offset)


@triton.jit(do_not_specialize=["M"])
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, M, x_stride, x_head_stride, g_stride, g_head_stride,
                           eps, HV: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                           ROUND_PRODUCT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    # ROWS (token, head) rows of M = tokens * HV; x and the gate by their token and head strides (the gate is
    # a view of the input projection), the output contiguous
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    tok, head = rows // HV, rows % HV
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + (tok * x_stride + head * x_head_stride)[:, None] + cols[None, :], mask=mask, other=0.0)
    g = tl.load(gate_ptr + (tok * g_stride + head * g_head_stride)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) * (1.0 / N) + eps)  # torch's mean: the sum times 1/N
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)  # rounded to x's dtype before the weight
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    prod = normed * w[None, :]
    if ROUND_PRODUCT:  # weight * normed in the promoted dtype: x's own (else float32, nothing to round)
        prod = prod.to(x.dtype).to(tl.float32)
    # F.silu of the float32 gate as torch's CUDA kernel computes it: x / (1 + expf(-x)), an IEEE division
    e = libdevice.exp(-g) if LIBDEVICE_EXP else tl.exp(-g)
    act = tl.div_rn(g, 1.0 + e)
    out = (prod * act).to(out_ptr.dtype.element_ty)  # the float32 product, rounded once to x's dtype
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=mask)


def _token_head_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [tokens, heads, D] with unit stride along D (a view when possible)."""
    t3 = t if t.dim() == 3 else t.reshape(-1, 1, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(weight * rmsnorm(x).to(x.dtype)) * silu(gate.float())`` per head, rounded to x's dtype (the output norm
    of a Gated DeltaNet layer); x and gate [T, Hv, Dv], the gate possibly a strided view."""
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and x {tuple(x.shape)} must have one shape")
    x3, g3 = _token_head_rows(x), _token_head_rows(gate)
    t, hv, n = x3.shape
    out = torch.empty((t, hv, n), dtype=x.dtype, device=x.device)
    m = t * hv
    if m:
        block_n = triton.next_power_of_2(n)
        rows = max(1, min(_NORM_ELEMENTS // block_n, 16))
        _gated_rms_norm_kernel[(triton.cdiv(m, rows),)](
            x3, g3, weight, out, m, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), eps, HV=hv, N=n,
            BLOCK_N=block_n, ROWS=rows, ROUND_PRODUCT=torch.promote_types(x.dtype, weight.dtype) == x.dtype,
            LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=8 if block_n >= 4096 else 4, **_UNFUSED)
    return out.view(x.shape)
