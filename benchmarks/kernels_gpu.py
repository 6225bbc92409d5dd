"""Check and time llmcli's Triton attention kernels on a CUDA GPU at Qwen3-0.6B shapes.

Every case is first checked against the torch reference backend in bfloat16
(relative error of the norm <= 1e-2), then timed with ``triton.testing.do_bench``
(median, L2 flushed between runs). Decode prints the KV bytes read per second;
prefill prints TFLOP/s of the causal attention it does.

    python benchmarks/kernels_gpu.py [--quick] [--tune]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from llmcli.kernels import triton_decode, triton_prefill
from llmcli.kernels.backend import AttentionMetadata
from llmcli.kernels.torch_backend import TorchAttentionBackend, gather_kv_torch
from llmcli.kernels.triton_decode import choose_num_splits, paged_decode, scratch_numel
from llmcli.kernels.triton_prefill import prefill_paged

H, KH, D, BS = 16, 8, 128, 256  # Qwen3-0.6B attention, llmcli's default block size
DT = torch.bfloat16


def paged_case(ctx_lens: list[int], q_lens: list[int]):
    """Random caches holding exactly these sequences, under randomly permuted block tables."""
    per = [triton.cdiv(c, BS) for c in ctx_lens]
    num_blocks = sum(per)
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = torch.full((len(ctx_lens), max(per)), -1, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(per):
        tables[i, :n] = perm[start : start + n]
        start += n
    k_cache = torch.randn(num_blocks, BS, KH, D, dtype=DT, device="cuda")
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    total_q = sum(q_lens)
    q = torch.randn(total_q, H, D, dtype=DT, device="cuda")
    return q, k_cache, v_cache, tables, lens


def reference(meta: AttentionMetadata, q, k_cache, v_cache) -> torch.Tensor:
    """The torch backend's answer. It stores before attending (slot -1 here: the cache already
    holds everything) and reads a chunk without prefix from k/v, so pass the cached rows as k/v."""
    ref = TorchAttentionBackend(H, KH, D, D ** -0.5, BS)
    meta.slot_mapping = torch.full((q.shape[0],), -1, dtype=torch.int64, device="cuda")
    ref.prepare(meta)
    cu_q = meta.cu_seqlens_q.tolist() if meta.is_prefill else list(range(q.shape[0] + 1))
    ks, vs = [], []
    for i, ctx in enumerate(meta.context_lens.tolist()):
        n = cu_q[i + 1] - cu_q[i]
        ks.append(gather_kv_torch(k_cache, meta.block_tables[i], ctx)[ctx - n :])
        vs.append(gather_kv_torch(v_cache, meta.block_tables[i], ctx)[ctx - n :])
    return ref.forward(q, torch.cat(ks), torch.cat(vs), k_cache, v_cache)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def time_graph(fns: list) -> float:
    """Median ms per call of each fn, run back to back inside one CUDA graph (as decode runs in
    the engine): no Python launch overhead, and the cases rotate so caches don't serve the KV."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / len(fns)


def copies_for(nbytes: int) -> int:
    return max(1, min(32, triton.cdiv(512 << 20, nbytes)))  # >= 512 MiB touched per replay


def bench_decode(batch: int, ctx: int, check: bool, splits: int | None = None) -> tuple[float, float, int]:
    num_splits = splits or choose_num_splits(batch, KH, ctx)
    kv_bytes = batch * ctx * KH * D * 2 * DT.itemsize
    n_out, n_lse = scratch_numel(batch, H, D, num_splits)
    part_out = torch.empty(max(n_out, 1), dtype=torch.float32, device="cuda")
    part_lse = torch.empty(max(n_lse, 1), dtype=torch.float32, device="cuda")
    fns = []
    for i in range(copies_for(kv_bytes)):
        q, k_cache, v_cache, tables, lens = paged_case([ctx] * batch, [1] * batch)
        out = torch.empty_like(q)
        fns.append(lambda q=q, k=k_cache, v=v_cache, t=tables, n=lens, o=out: paged_decode(
            q, k, v, t, n, D ** -0.5, num_splits, part_out, part_lse, out=o))
        if check and i == 0:
            meta = AttentionMetadata(is_prefill=False, slot_mapping=None, context_lens=lens, block_tables=tables,
                                     max_seqlen_k=ctx)
            err = rel_err(fns[0](), reference(meta, q, k_cache, v_cache))
            assert err <= 1e-2, f"decode batch {batch} ctx {ctx}: rel err {err:.2e}"
    ms = time_graph(fns)
    return ms, kv_bytes / ms / 1e6, num_splits


def bench_prefill(prefix: int, q_len: int, batch: int, check: bool) -> tuple[float, float]:
    ctx = prefix + q_len
    fns = []
    for i in range(copies_for(batch * ctx * KH * D * 2 * DT.itemsize)):
        q, k_cache, v_cache, tables, lens = paged_case([ctx] * batch, [q_len] * batch)
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q_len
        out = torch.empty_like(q)
        # the chunks' own K/V, packed (the kernel reads them there and only the prefix from the cache)
        k_new = torch.cat([gather_kv_torch(k_cache, tables[j], ctx)[prefix:] for j in range(batch)])
        v_new = torch.cat([gather_kv_torch(v_cache, tables[j], ctx)[prefix:] for j in range(batch)])
        fns.append(lambda q=q, kn=k_new, vn=v_new, k=k_cache, v=v_cache, t=tables, c=cu_q, n=lens, o=out:
                   prefill_paged(q, kn, vn, k, v, t, c, n, q_len, D ** -0.5, out=o))
        if check and i == 0:
            meta = AttentionMetadata(is_prefill=True, slot_mapping=None, context_lens=lens, block_tables=tables,
                                     cu_seqlens_q=cu_q, max_seqlen_q=q_len, max_seqlen_k=ctx, has_prefix=True)
            err = rel_err(fns[0](), reference(meta, q, k_cache, v_cache))
            assert err <= 1e-2, f"prefill prefix {prefix} q {q_len}: rel err {err:.2e}"
    ms = time_graph(fns)
    # visible keys per query: prefix + its index + 1; two matmuls of 2*D flops per (query, key, head)
    pairs = batch * (q_len * prefix + q_len * (q_len + 1) // 2)
    return ms, 4 * D * H * pairs / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--tune", action="store_true", help="sweep decode tile/warp/stage settings")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)

    batches = [1, 16, 256] if args.quick else [1, 4, 16, 64, 128, 256]
    ctxs = [512, 8192] if args.quick else [512, 1024, 2048, 4096, 8192]
    print(f"\ndecode  H={H} KH={KH} D={D} block={BS} bf16")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'us':>9} {'GB/s':>8}")
    for batch, ctx in itertools.product(batches, ctxs):
        ms, gbs, splits = bench_decode(batch, ctx, check=batch <= 64)
        print(f"{batch:>6} {ctx:>6} {splits:>6} {ms * 1e3:>9.1f} {gbs:>8.0f}")

    if args.tune:
        shapes = [(1, 8192), (4, 4096), (16, 2048), (64, 2048), (256, 1024)]
        print("\ndecode tuning: GB/s at (batch, ctx) =", shapes)
        for block_n, warps, stages in [(64, 4, 3), (64, 2, 3), (32, 4, 3), (32, 2, 4), (128, 4, 3)]:
            triton_decode.BLOCK_N, triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = block_n, warps, stages
            row = [bench_decode(b, c, check=False)[1] for b, c in shapes]
            print(f"BLOCK_N {block_n:>4} warps {warps} stages {stages}: " + " ".join(f"{g:>6.0f}" for g in row))
        triton_decode.BLOCK_N, triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = 64, 4, 3
        for b, c in shapes[:4]:
            row = {n: bench_decode(b, c, check=False, splits=n)[1] for n in (1, 2, 4, 8, 16, 32, 64)}
            print(f"splits at batch {b} ctx {c}: " + " ".join(f"{n}:{g:.0f}" for n, g in row.items()))

    print(f"\nprefill (paged, with prefix)  H={H} KH={KH} D={D} block={BS} bf16")
    print(f"{'batch':>6} {'prefix':>6} {'q_len':>6} {'ms':>9} {'TFLOP/s':>8}")
    cases = [(1, 0, 8192), (1, 4096, 4096), (8, 0, 1024), (16, 0, 512), (4, 2000, 512), (64, 1000, 16)]
    for batch, prefix, q_len in cases[: 3 if args.quick else None]:
        ms, tflops = bench_prefill(prefix, q_len, batch, check=True)
        print(f"{batch:>6} {prefix:>6} {q_len:>6} {ms:>9.3f} {tflops:>8.1f}")
    if args.tune:
        base = triton_prefill._tiles
        for tiles in [(128, 128, 8, 2), (128, 128, 4, 2), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4),
                      (64, 32, 4, 3), (128, 64, 4, 3)]:
            triton_prefill._tiles = lambda *_, t=tiles: triton_prefill.Tiles(*t)
            row = [bench_prefill(p, n, b, check=False)[1] for b, p, n in cases]
            print(f"prefill tiles {tiles}: " + " ".join(f"{t:.1f}" for t in row))
        triton_prefill._tiles = base


if __name__ == "__main__":
    main()
