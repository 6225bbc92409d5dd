"""Prefill attention kernel: the old Triton kernel against the new one, and a sweep of the new one's tiles.

Shapes (issue #13): (a) 16 prompts x 570 tokens, (b) 4 x 2048, (c) 1 x 8192, (d) 16 x 570 behind a
512-token cached prefix (paged path, block size 256), (e) 22 prompts of 300-1000 tokens in one varlen
batch (the prefill-heavy job's chunks); for Qwen3-0.6B's heads (16 q / 8 kv / 128) and Qwen3-8B's
(32 / 8 / 128), bfloat16. Every kernel run is checked against torch's scaled_dot_product_attention in
float32, prompt by prompt (max abs diff over all prompts), and timed with ``triton.testing.do_bench``
(median ms). FLOPs are those of the causal attention actually needed:

    FLOPs = 4 * heads * head_dim * sum over prompts of q_len * (prefix + (q_len + 1) / 2)

(two matmuls, QK^T and PV, of 2 * head_dim FLOPs per visible (query, key, head) triple). torch's SDPA
on the GPU (flash, equal-length prompts as a padded batch, KV heads repeated) is timed as a yardstick.

    python benchmarks/prefill_attention_gpu.py                    # GPU: ~3 minutes
    python benchmarks/prefill_attention_gpu.py --no-sweep         # old vs new defaults only
    python benchmarks/prefill_attention_gpu.py --device cpu       # smoke test: interpreter, float32, tiny shapes

The old kernel (before the GQA-grouped rewrite) is kept below, here only, as the baseline: one program per
query head, and on the paged path every key (the chunk's own too) read through the block table. The new
paged path reads only the prefix from the cache and the chunk's own keys from the packed k/v.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

if __name__ == "__main__" and "--device" in sys.argv and "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from llmcli.kernels import triton_prefill
from llmcli.kernels.triton_prefill import Tiles, prefill_paged, prefill_varlen


# -- the old kernel (llmcli before this change), verbatim but for its names ------------------------------
@triton.jit
def _old_attend_tile(
    q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2,
    k_base, v_base, bt_row, tok0,
    stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, MASKED: tl.constexpr,
):
    """Fold keys [n0, n0 + BLOCK_N) into the running (max, sum, acc) of one query tile."""
    pos = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if PAGED:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < k_len, other=0).to(tl.int64)
        k_rows = blk * stride_kcb + (pos % BLOCK_SIZE) * stride_kcs
        v_rows = blk * stride_vcb + (pos % BLOCK_SIZE) * stride_vcs
    else:
        k_rows = (tok0 + pos).to(tl.int64) * stride_kt
        v_rows = (tok0 + pos).to(tl.int64) * stride_vt
    if MASKED:
        in_range = pos < k_len
        k = tl.load(k_base + k_rows[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_base + k_rows[:, None] + d[None, :])
        v = tl.load(v_base + v_rows[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k)) * scale_log2  # scaled in fp32: exp2 below, so log2(e) folded in
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < k_len)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows whose every key so far is masked keep m == -inf; shift by 0 to avoid inf - inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per step (see triton_decode)
def _old_prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    stride_bt, stride_ot, stride_oh, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
):
    h = tl.program_id(0)
    m_blk = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    tok0 = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - tok0
    if m_blk * BLOCK_M >= q_len:
        return
    if PAGED:
        k_len = tl.load(context_lens_ptr + b)
    else:
        k_len = q_len
    first_pos = k_len - q_len  # absolute position of the chunk's first query

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = first_pos + offs_m
    d = tl.arange(0, HEAD_DIM)
    q_rows = (tok0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mask_m[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    kvh = h // GROUP
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys before the tile's first query are visible to all its rows: no mask needed
    full_end = ((first_pos + m_blk * BLOCK_M) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _old_attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2, k_base, v_base, bt_row, tok0,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, False)
    last_pos = first_pos + tl.minimum((m_blk + 1) * BLOCK_M, q_len)  # one past the tile's last query
    for n0 in range(full_end, last_pos, BLOCK_N):
        m_i, l_i, acc = _old_attend_tile(
            q, m_i, l_i, acc, n0, q_pos, k_len, scale_log2, k_base, v_base, bt_row, tok0,
            stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, True)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])



def _old_tiles(head_dim: int, elem_size: int, max_seqlen_q: int) -> Tiles:
    """The old kernel's launch shapes (one program per q head, 128x128 tiles from 2048-token chunks)."""
    if elem_size > 2 or head_dim > 128:
        return Tiles(64, 32, 4, 2)
    if max_seqlen_q >= 2048:
        return Tiles(128, 128, 8, 2)
    return Tiles(64, 64, 4, 3)


def old_prefill(case: Case, out: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """The old kernel's launch, plain or paged as the case is."""
    q = case.q
    num_heads, head_dim = q.shape[1], q.shape[2]
    t = tiles or _old_tiles(head_dim, q.element_size(), case.max_q)
    if case.paged:
        kc, vc = case.k_cache, case.v_cache
        tensors = (kc, vc, case.tables, case.cu_q, case.lens)
        strides = (0, kc.stride(2), 0, vc.stride(2), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                   case.tables.stride(0))
        group, block_size = num_heads // kc.shape[2], kc.shape[1]
    else:
        k, v = case.k, case.v
        tensors = (k, v, case.cu_q, case.cu_q, case.cu_q)
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0, 0, 0, 0, 0)
        group, block_size = num_heads // k.shape[1], 1
    grid = (num_heads, triton.cdiv(case.max_q, t.block_m), len(case.q_lens))
    _old_prefill_kernel[grid](
        q, *tensors, out, q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        case.scale * 1.4426950408889634, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, PAGED=case.paged, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


# -- cases -----------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    q_lens: list[int]
    prefix: int
    paged: bool
    q: torch.Tensor
    k: torch.Tensor          # the chunks' own keys, packed [T, KH, D] (plain path)
    v: torch.Tensor
    k_full: list[torch.Tensor]  # per prompt, prefix + chunk keys [ctx, KH, D] (reference)
    v_full: list[torch.Tensor]
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    tables: torch.Tensor | None
    lens: torch.Tensor
    cu_q: torch.Tensor
    scale: float

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    def flops(self) -> float:
        heads, d = self.q.shape[1], self.q.shape[2]
        return 4 * heads * d * sum(n * (self.prefix + (n + 1) / 2) for n in self.q_lens)


def make_case(name: str, q_lens: list[int], prefix: int, heads: tuple[int, int, int], dtype: torch.dtype,
              device: str, block_size: int) -> Case:
    h, kh, d = heads
    ctx = [prefix + n for n in q_lens]
    q = torch.randn(sum(q_lens), h, d, dtype=dtype, device=device)
    k_full = [torch.randn(c, kh, d, dtype=dtype, device=device) for c in ctx]
    v_full = [torch.randn(c, kh, d, dtype=dtype, device=device) for c in ctx]
    k = torch.cat([kf[prefix:] for kf in k_full])
    v = torch.cat([vf[prefix:] for vf in v_full])
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    k_cache = v_cache = tables = None
    if prefix:
        per = [triton.cdiv(c, block_size) for c in ctx]
        perm = torch.randperm(sum(per)).tolist()
        tables = torch.full((len(ctx), max(per) + 1), -1, dtype=torch.int32)
        k_cache = torch.full((sum(per), block_size, kh, d), float("nan"), dtype=dtype, device=device)
        v_cache = torch.full_like(k_cache, float("nan"))  # unused slots NaN: a stray read fails the check
        used = 0
        for i, c in enumerate(ctx):
            tables[i, : per[i]] = torch.tensor(perm[used : used + per[i]], dtype=torch.int32)
            used += per[i]
            for j in range(per[i]):
                rows = slice(j * block_size, min(c, (j + 1) * block_size))
                n = rows.stop - rows.start
                k_cache[int(tables[i, j]), :n] = k_full[i][rows]
                v_cache[int(tables[i, j]), :n] = v_full[i][rows]
        tables = tables.to(device)
    return Case(name, q_lens, prefix, bool(prefix), q, k, v, k_full, v_full, k_cache, v_cache, tables, lens, cu_q,
                d ** -0.5)


def reference(case: Case) -> torch.Tensor:
    """torch SDPA in float32, one prompt at a time, keys bottom-right aligned under the causal mask."""
    outs, start = [], 0
    group = case.q.shape[1] // case.k.shape[1]
    for i, n in enumerate(case.q_lens):
        q = case.q[start : start + n].float().transpose(0, 1)
        k = case.k_full[i].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = case.v_full[i].float().repeat_interleave(group, dim=1).transpose(0, 1)
        c = k.shape[1]
        mask = torch.arange(c, device=q.device)[None, :] <= (c - n + torch.arange(n, device=q.device))[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def new_prefill(case: Case, out: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    if case.paged:
        return prefill_paged(case.q, case.k, case.v, case.k_cache, case.v_cache, case.tables, case.cu_q, case.lens,
                             case.max_q, case.scale, out=out, tiles=tiles)
    return prefill_varlen(case.q, case.k, case.v, case.cu_q, case.max_q, case.scale, out=out, tiles=tiles)


def sdpa_padded(case: Case):
    """torch's own SDPA (flash on the GPU) on equal-length prompts without prefix, or None."""
    if case.paged or len(set(case.q_lens)) > 1:
        return None
    b, n = len(case.q_lens), case.q_lens[0]
    group = case.q.shape[1] // case.k.shape[1]
    q = case.q.view(b, n, -1, case.q.shape[2]).transpose(1, 2)
    k = case.k.repeat_interleave(group, dim=1).view(b, n, -1, case.q.shape[2]).transpose(1, 2).contiguous()
    v = case.v.repeat_interleave(group, dim=1).view(b, n, -1, case.q.shape[2]).transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale)


def time_ms(fn, device: str) -> float:
    if device == "cpu":  # the interpreter: one run is all a smoke test needs
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def run_one(label: str, fn, case: Case, ref: torch.Tensor, device: str) -> tuple[float, float, float] | None:
    """(ms, TFLOP/s, max abs diff) of one kernel on one case; None if it could not be launched."""
    out = torch.full_like(case.q, float("nan"))
    try:
        fn(case, out)
        diff = (out.float() - ref).abs().max().item()  # NaN (an unwritten row) propagates into the max
        ms = time_ms(lambda: fn(case, out), device)
    except Exception as e:  # e.g. out of shared memory for a tile shape: report it, go on
        print(f"  {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
        return None
    return ms, case.flops() / ms / 1e9, diff


def tiles_str(t: Tiles) -> str:
    return (f"{t.block_m}x{t.block_n}/w{t.num_warps}/s{t.num_stages}" + (f"/r{t.maxnreg}" if t.maxnreg else "")
            + ("/1loop" if t.one_loop else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--no-sweep", action="store_true", help="old vs new default tiles only")
    ap.add_argument("--budget", type=float, default=270.0,
                    help="seconds after which the sweep is cut short (old vs new still run), so the summary prints")
    args = ap.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    if args.device == "cuda":
        assert torch.cuda.is_available(), "needs CUDA (or --device cpu for the smoke test)"
        print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
        dtype, block_size = torch.bfloat16, 256
        models = {"0.6B": (16, 8, 128), "8B": (32, 8, 128)}
        varied = torch.randint(300, 1001, (22,)).tolist()
        shapes = [("a 16x570", [570] * 16, 0), ("b 4x2048", [2048] * 4, 0), ("c 1x8192", [8192], 0),
                  ("d 16x570+512", [570] * 16, 512), ("e 22x300-1000", varied, 0)]
        # r128: registers capped at 128 per thread, so that two 8-warp programs fit on an SM (see
        # prefill_attention_sm90_resources.py for registers, spills and shared memory of each)
        sweep = [Tiles(*t) for t in [
            (128, 32, 8, 4, 128), (128, 32, 8, 3, 128), (128, 32, 8, 4), (128, 64, 8, 2, 128), (128, 64, 8, 3),
            (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 4),
            (128, 32, 8, 4, 128, True), (64, 64, 4, 3, None, True)]]  # True: one masked loop (Tiles.one_loop)
    else:
        print("smoke test on the CPU: Triton interpreter, float32, tiny shapes; times mean nothing")
        dtype, block_size = torch.float32, 16
        models = {"tiny": (4, 2, 32), "tiny-g4": (8, 2, 32)}
        shapes = [("a 3x37", [37] * 3, 0), ("c 1x100", [100], 0), ("d 3x37+40", [37] * 3, 40),
                  ("e 1-70", [1, 70, 13], 0)]
        sweep = [Tiles(16, 16, 4, 1), Tiles(128, 32, 8, 4, 128), Tiles(64, 128, 4, 3), Tiles(64, 32, 4, 2, None, True)]
    if args.no_sweep:
        sweep = []

    summary = []
    for model, heads in models.items():
        for name, q_lens, prefix in shapes:
            case = make_case(name, q_lens, prefix, heads, dtype, args.device, block_size)
            ref = reference(case)
            group = heads[0] // heads[1]
            default = triton_prefill._tiles(heads[2], case.q.element_size(), case.max_q, group)
            print(f"\n{model} (H {heads[0]} / KH {heads[1]} / D {heads[2]})  {name}: {sum(q_lens)} query tokens, "
                  f"{case.flops() / 1e12:.3f} TFLOP")
            print(f"  {'kernel':<40} {'ms':>8} {'TFLOP/s':>8} {'max|diff|':>10}")
            rows = {}
            for label, fn in [(f"old {tiles_str(_old_tiles(heads[2], case.q.element_size(), case.max_q))}",
                               old_prefill), (f"new default {tiles_str(default)}", new_prefill)]:
                rows[label.split()[0]] = r = run_one(label, fn, case, ref, args.device)
                if r:
                    print(f"  {label:<40} {r[0]:>8.3f} {r[1]:>8.1f} {r[2]:>10.2e}")
            sdpa = sdpa_padded(case) if args.device == "cuda" else None
            if sdpa is not None:
                ms = time_ms(sdpa, args.device)
                print(f"  {'torch sdpa (padded batch)':<40} {ms:>8.3f} {case.flops() / ms / 1e9:>8.1f}")
            best = (tiles_str(default), rows["new"]) if rows["new"] else ("-", None)
            for t in sweep:
                if t.block_m < group:
                    continue
                if time.perf_counter() - start > args.budget:
                    print(f"  (sweep cut: past the {args.budget:.0f} s budget)")
                    break
                r = run_one(f"new {tiles_str(t)}", lambda c, o, t=t: new_prefill(c, o, t), case, ref, args.device)
                if r:
                    print(f"  {'new ' + tiles_str(t):<40} {r[0]:>8.3f} {r[1]:>8.1f} {r[2]:>10.2e}")
                    if best[1] is None or r[0] < best[1][0]:
                        best = (tiles_str(t), r)
            summary.append((model, name, rows["old"], rows["new"], best))

    print("\n=== prefill attention: old kernel vs new (ms, TFLOP/s; FLOPs = 4*H*D*sum q_len*(prefix+(q_len+1)/2))")
    print(f"{'model':<6} {'shape':<16} {'old ms':>8} {'TF/s':>6} {'new ms':>8} {'TF/s':>6} {'x':>5} "
          f"{'best tiles':<27} {'ms':>8} {'TF/s':>6} {'diff old':>9} {'diff new':>9}")
    for model, name, old, new, (bt, br) in summary:
        def f(r, i, fmt):
            return format(r[i], fmt) if r else "-"
        speed = f"{old[0] / new[0]:.2f}" if old and new else "-"
        print(f"{model:<6} {name:<16} {f(old, 0, '8.3f'):>8} {f(old, 1, '6.0f'):>6} {f(new, 0, '8.3f'):>8} "
              f"{f(new, 1, '6.0f'):>6} {speed:>5} {bt:<27} {f(br, 0, '8.3f'):>8} {f(br, 1, '6.0f'):>6} "
              f"{f(old, 2, '9.1e'):>9} {f(new, 2, '9.1e'):>9}")


if __name__ == "__main__":
    main()
