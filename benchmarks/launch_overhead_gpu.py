#!/usr/bin/env python
"""Host cost of one eager kernel launch (issue #13): prefill and mixed steps run outside CUDA graphs.

A mixed step of the prefill-heavy preset measured 33 ms of wall time for 18 ms of kernels (run 23), and the
fused-store micro-benchmark took ~90 us of host time per eager Triton launch. This script times, on the
GPU host, the host side of one call (500 calls back to back, no sync between them; the device work is tiny)
of: a torch add, a trivial Triton kernel through the JIT launcher (with and without a compile-option
keyword), llmcli's ``rms_norm`` / ``add_rms_norm`` / ``silu_and_mul`` / ``qk_norm_rotary`` wrappers, the
same RMSNorm kernel launched directly, and the paged-store kernel; then a cProfile of the ``add_rms_norm``
wrapper (top functions by own time), so the cost can be placed.

    python benchmarks/launch_overhead_gpu.py            # GPU: ~20 s
    python benchmarks/launch_overhead_gpu.py --device cpu --calls 20   # smoke test (interpreter)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--device" in sys.argv and "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from llmcli.kernels import triton_elementwise as te  # noqa: E402
from llmcli.kernels.triton_store import store_kv  # noqa: E402


@triton.jit
def _touch(x_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)


def per_call_us(fn, calls: int, device: str) -> tuple[float, float]:
    """Host microseconds per call (wall and this thread's CPU), calls back to back, synced only at the end."""
    for _ in range(5):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    w, c = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    wall, cpu = time.perf_counter() - w, time.thread_time() - c
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e6 * wall / calls, 1e6 * cpu / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    m, hidden, inter, hq, hk, d = args.tokens, 1024, 3072, 16, 8, 128
    x = torch.randn(m, hidden, device=dev, dtype=dtype)
    r = torch.randn(m, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    gu = torch.randn(m, 2 * inter, device=dev, dtype=dtype)
    qkv = torch.randn(m, (hq + 2 * hk) * d, device=dev, dtype=dtype)
    q = qkv[:, :hq * d].view(m, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(m, hk, d)
    v = qkv[:, (hq + hk) * d:].view(m, hk, d)
    qw, kw = torch.randn(d, device=dev, dtype=dtype), torch.randn(d, device=dev, dtype=dtype)
    pos = torch.arange(m, device=dev)
    cos, sin = torch.randn(m, d, device=dev), torch.randn(m, d, device=dev)
    blocks = -(-m // 256)
    kc = torch.zeros(blocks, 256, hk, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, device=dev)
    small = torch.zeros(128, device=dev)
    out = torch.empty_like(x)
    n = hidden
    rows = max(1, min(2048 // n, 16))

    def direct_norm(**opts):
        te._rms_norm_kernel[(triton.cdiv(m, rows),)](
            x, r, w, out, out, m, x.stride(0), r.stride(0), out.stride(0), out.stride(0), 1e-6,
            N=n, BLOCK_N=n, ROWS=rows, HAS_RESIDUAL=True, num_warps=4, **opts)

    cases = [
        ("torch add (dispatch baseline)", lambda: torch.add(x, r, out=out)),
        ("trivial Triton kernel, JIT launch", lambda: _touch[(1,)](small, N=128)),
        ("trivial Triton kernel + enable_fp_fusion=False", lambda: _touch[(1,)](small, N=128, enable_fp_fusion=False)),
        ("RMSNorm kernel direct, + enable_fp_fusion=False", lambda: direct_norm(enable_fp_fusion=False)),
        ("RMSNorm kernel direct, default options", lambda: direct_norm()),
        ("llmcli add_rms_norm wrapper", lambda: te.add_rms_norm(x, r, w, 1e-6)),
        ("llmcli silu_and_mul wrapper", lambda: te.silu_and_mul(gu)),
        ("llmcli qk_norm_rotary wrapper", lambda: te.qk_norm_rotary(q, k, pos, qw, kw, 1e-6, cos, sin)),
        ("llmcli qk_norm_rotary_store wrapper", lambda: te.qk_norm_rotary_store(q, k, v, pos, qw, kw, 1e-6, cos, sin,
                                                                             kc, vc, slots)),
        ("llmcli store_kv", lambda: store_kv(k, v, kc, vc, slots)),
    ]
    print(f"host cost per call, {args.calls} calls back to back, {m} tokens, device {args.device}, "
          f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'call':52s} {'wall us':>9s} {'CPU us':>9s}")
    for name, fn in cases:
        try:
            wall, cpu = per_call_us(fn, args.calls, args.device)
            print(f"{name:52s} {wall:9.1f} {cpu:9.1f}")
        except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name:52s} FAILED {type(exc).__name__}: {exc}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(min(args.calls, 300)):
        te.add_rms_norm(x, r, w, 1e-6)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print("\ncProfile of add_rms_norm (tottime):")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
