"""The machine's ceilings (device-to-device copy bandwidth, matmul rate) and the timing helpers they use."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.harness.output import log, say
from benchmarks.harness.report import Report

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        log(f"cuda memory after cleanup: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")


def time_op(op: Callable[[], Any], device: str, reps: int, warmup: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``op`` (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        op()
    sync(device)
    times = []
    if device == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in pairs:
            a.record()
            op()
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in pairs]
    else:
        for _ in range(reps):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
    return times


# -- 1. ceilings -------------------------------------------------------------------------------------

def measure_ceilings(args: argparse.Namespace, report: Report) -> None:
    dev, dtype = args.device, DTYPES[args.ceiling_dtype]
    out = report.data["ceilings"]
    out.update(device=dev, dtype=args.ceiling_dtype)
    if args.copy_bw is not None:
        out.update(copy_bytes_per_s=args.copy_bw * 1e12, copy_source="--copy-bw")
    else:
        numel = int(args.copy_gib * 2**30) // dtype.itemsize
        src = torch.randn(numel, device=dev).to(dtype) if dev == "cpu" else torch.randn(numel, dtype=dtype, device=dev)
        dst = torch.empty_like(src)
        times = time_op(lambda: dst.copy_(src), dev, args.ceiling_reps, warmup=3)
        moved = 2 * numel * dtype.itemsize  # read once, written once
        med = statistics.median(times)
        out.update(copy_bytes_per_s=moved / med, copy_tensor_bytes=numel * dtype.itemsize, copy_median_s=med,
                   copy_reps=len(times), copy_source="measured")
        del src, dst
        free_memory(dev)
    say(f"copy bandwidth: {out['copy_bytes_per_s'] / 1e12:.3f} TB/s ({out['copy_source']}; bytes read + written)")
    if args.matmul_tflops is not None:
        out.update(matmul_flops_per_s=args.matmul_tflops * 1e12, matmul_source="--matmul-tflops")
    else:
        n = args.matmul_n
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        c = torch.empty(n, n, dtype=dtype, device=dev)
        times = time_op(lambda: torch.matmul(a, b, out=c), dev, args.ceiling_reps, warmup=5)
        med = statistics.median(times)
        out.update(matmul_flops_per_s=2 * n ** 3 / med, matmul_n=n, matmul_median_s=med, matmul_reps=len(times),
                   matmul_source="measured")
        del a, b, c
        free_memory(dev)
    how = out["matmul_source"] + (f", {args.ceiling_dtype} {out['matmul_n']}^3" if "matmul_n" in out else "")
    say(f"matmul rate: {out['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({how})")
