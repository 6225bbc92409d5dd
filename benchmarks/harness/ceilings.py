"""The machine's ceilings (device-to-device copy bandwidth, matmul rates) and the timing helpers they use."""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.harness.output import log, say

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
    if device != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        return times
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in pairs:
        a.record()
        op()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in pairs]


def measure_ceilings(device: str, tiny: bool, fp8: bool = False) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written), the matmul rate, and with ``fp8`` the row-wise scaled FP8 matmul
    rate (``torch._scaled_mm``, what ``quantization=fp8`` runs); medians, bf16 on the GPU, fp32 on the CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    big = device == "cuda" and not tiny
    numel, n, reps = ((2 << 30) // dtype.itemsize, 8192, 20) if big else (2**20, 256, 5)
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {"device": device, "dtype": str(dtype).removeprefix("torch."), "matmul_n": n}
    out["copy_bytes_per_s"] = 2 * numel * dtype.itemsize / statistics.median(
        time_op(lambda: dst.copy_(src), device, reps, warmup=3))
    del src, dst
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out["matmul_flops_per_s"] = 2 * n**3 / statistics.median(time_op(lambda: a @ b, device, reps, warmup=5))
    if fp8:
        from llmcli.layers.quantization.fp8 import quantize_per_channel, quantize_per_token

        (qa, sa), (qb, sb) = quantize_per_token(a.to(torch.bfloat16)), quantize_per_channel(b.float())
        out["fp8_matmul_flops_per_s"] = 2 * n**3 / statistics.median(time_op(
            lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16),
            device, reps, warmup=3))
    del a, b
    free_memory(device)
    say(f"ceilings: copy {out['copy_bytes_per_s'] / 1e12:.3f} TB/s (read + written), matmul "
        f"{out['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({out['dtype']} {n}^3)"
        + (f", FP8 matmul {out['fp8_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s" if fp8 else ""))
    return out
