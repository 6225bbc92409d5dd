"""The model's elementwise ops, torch.compile (the old CUDA path) vs the Triton kernels (issue #13, #12).

For Qwen3-0.6B and -8B sizes and token counts M in (1, 64, 256, 9120, 16384), each of RMSNorm, add+RMSNorm,
SiLU-and-mul and q/k-norm+rotary is timed as (a) ``compile_on_cuda`` of the eager function (dynamic=True,
as the model ran it before) and (b) kernels/triton_elementwise.py, with ``triton.testing.do_bench`` (median,
L2 flushed between runs). Prints µs, achieved GB/s (bytes the op must move / time), and the max abs difference
of each against the eager function (plus the share of elements that differ). The first call of each (Dynamo +
Inductor, or Triton's JIT; summed over all cases, so recompilations count) is timed too: start-up time (#12). Last: a results table and the estimated
elementwise ms of one 0.6B prefill forward of 9,120 tokens (28 layers).

    python benchmarks/elementwise_gpu.py              # on CUDA, about 2 minutes
    python benchmarks/elementwise_gpu.py --device cpu # smoke test: Triton's interpreter, tiny sizes
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.kernel_device import use_kernel_device  # noqa: E402

MODELS = {  # hidden, intermediate, q heads, kv heads, head_dim
    "0.6B": (1024, 3072, 16, 8, 128),
    "8B": (4096, 12288, 32, 8, 128),
}
TINY = {"tiny": (64, 96, 4, 2, 64)}
M_GPU = (1, 64, 256, 9120, 16384)
M_CPU = (1, 7)
EPS = 1e-6


@dataclass
class Row:
    model: str
    op: str
    m: int
    compiled_us: float
    triton_us: float
    gbytes: float
    diff_compiled: float
    diff_triton: float
    share_triton: float


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--m", default=None, help="comma-separated token counts (default: %s)" % (M_GPU,))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    use_kernel_device(args.device)
    import triton.testing

    from llmcli.kernels import triton_elementwise as te
    from llmcli.layers.activation import silu_and_mul
    from llmcli.layers.compile import compile_on_cuda
    from llmcli.layers.norm import add_rms_norm, rms_norm
    from llmcli.layers.rotary import RotaryEmbedding
    from llmcli.layers.rotary import qk_norm_rotary

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
    models = TINY if args.device == "cpu" else MODELS
    if args.models:
        models = {k: MODELS[k] for k in args.models.split(",")}
    ms = M_CPU if args.device == "cpu" else M_GPU
    if args.m:
        ms = tuple(int(v) for v in args.m.split(","))
    elt = torch.empty((), dtype=dtype).element_size()

    # op name -> (eager function, kernel, inputs for (model sizes, M), bytes the op has to move)
    def norm_inputs(size, m):
        hidden = size[0]
        return (torch.randn(m, hidden, dtype=dtype, device=device), 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device), EPS)

    def add_norm_inputs(size, m):
        x, w, eps = norm_inputs(size, m)
        return x, torch.randn_like(x), w, eps

    def silu_inputs(size, m):
        return (3 * torch.randn(m, 2 * size[1], dtype=dtype, device=device),)

    rotaries = {}

    def qk_inputs(size, m):
        _, _, hq, hk, d = size
        rot = rotaries.setdefault(d, RotaryEmbedding(d, 40960, 1_000_000.0).to(device))
        qkv = torch.randn(m, (hq + 2 * hk) * d, dtype=dtype, device=device)
        q = qkv[:, : hq * d].view(m, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(m, hk, d)
        pos = torch.randint(0, 40960, (m,), device=device)
        w = 1 + 0.1 * torch.randn(d, dtype=dtype, device=device)
        return q, k, pos, w, w.clone(), EPS, rot.cos, rot.sin

    ops = {
        "rms_norm": (rms_norm.__wrapped__, te.rms_norm, norm_inputs, lambda s, m: 2 * m * s[0] * elt),
        "add_rms_norm": (add_rms_norm.__wrapped__, te.add_rms_norm, add_norm_inputs, lambda s, m: 4 * m * s[0] * elt),
        "silu_and_mul": (silu_and_mul.__wrapped__, te.silu_and_mul, silu_inputs, lambda s, m: 3 * m * s[1] * elt),
        "qk_norm_rotary": (qk_norm_rotary.__wrapped__, te.qk_norm_rotary, qk_inputs,
                           lambda s, m: 2 * m * (s[2] + s[3]) * s[4] * elt + 2 * m * s[4] * 4 + 8 * m),
    }
    compiled = {name: compile_on_cuda(eager) for name, (eager, *_rest) in ops.items()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def bench_us(fn) -> float:
        if device.type == "cuda":
            return 1000 * triton.testing.do_bench(fn, warmup=10, rep=40)
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e6

    def as_tuple(out):
        return out if isinstance(out, tuple) else (out,)

    def diff(out, ref) -> tuple[float, float]:
        worst, differ, total = 0.0, 0, 0
        for o, r in zip(as_tuple(out), as_tuple(ref)):
            assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
            worst = max(worst, (o.float() - r.float()).abs().max().item())
            differ += (o != r).sum().item()
            total += r.numel()
        return worst, differ / max(total, 1)

    first_call: dict[str, tuple[float, float]] = {}
    rows: list[Row] = []
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"dtype {dtype}")
    for model, size in models.items():
        for m in ms:
            for name, (eager, kernel, make, nbytes) in ops.items():
                inputs = make(size, m)
                ref = eager(*inputs)
                sync()
                t0 = time.perf_counter()
                out_c = compiled[name](*inputs)
                sync()
                t1 = time.perf_counter()
                out_t = kernel(*inputs)
                sync()
                t2 = time.perf_counter()
                c0, k0 = first_call.get(name, (0.0, 0.0))  # summed: every (re)compilation of each path
                first_call[name] = (c0 + t1 - t0, k0 + t2 - t1)
                c_us = bench_us(lambda: compiled[name](*inputs))
                t_us = bench_us(lambda: kernel(*inputs))
                dc, _ = diff(out_c, ref)
                dt, share = diff(out_t, ref)
                row = Row(model, name, m, c_us, t_us, nbytes(size, m) / 1e9, dc, dt, share)
                rows.append(row)
                print(f"{model:>5} {name:<15} M={m:<6} compiled {c_us:9.1f} us {row.gbytes / c_us * 1e6:7.0f} GB/s | "
                      f"triton {t_us:9.1f} us {row.gbytes / t_us * 1e6:7.0f} GB/s | max|diff| vs eager "
                      f"compiled {dc:.3g} triton {dt:.3g} ({share:.2%} differ)", flush=True)
                del inputs, ref, out_c, out_t

    print("\nfirst calls (compilations; summed over every model and M) seconds:  op  compiled  triton")
    for name, (c, t) in first_call.items():
        print(f"  {name:<15} {c:7.2f}  {t:7.2f}")
    print(f"\n{'model':>5} {'op':<15} {'M':>6} {'compiled us':>12} {'triton us':>10} {'GB/s c':>7} {'GB/s t':>7} "
          f"{'speedup':>7} {'diff c':>8} {'diff t':>8}")
    for r in rows:
        print(f"{r.model:>5} {r.op:<15} {r.m:>6} {r.compiled_us:12.1f} {r.triton_us:10.1f} "
              f"{r.gbytes / r.compiled_us * 1e6:7.0f} {r.gbytes / r.triton_us * 1e6:7.0f} "
              f"{r.compiled_us / r.triton_us:7.2f} {r.diff_compiled:8.3g} {r.diff_triton:8.3g}")
    # per decoder layer: two add+RMSNorm, one SiLU-and-mul, one q/k norm+rotary
    per_layer = {"add_rms_norm": 2, "silu_and_mul": 1, "qk_norm_rotary": 1}
    for model, layers in (("0.6B", 28), ("8B", 36)):
        for m in (9120,):
            sel = {r.op: r for r in rows if r.model == model and r.m == m}
            if set(per_layer) <= set(sel):
                c = sum(n * sel[op].compiled_us for op, n in per_layer.items()) * layers / 1000
                t = sum(n * sel[op].triton_us for op, n in per_layer.items()) * layers / 1000
                print(f"{model} forward of {m} tokens, {layers} layers: elementwise {c:.2f} ms compiled -> {t:.2f} ms triton")
    worst = max(r.diff_triton for r in rows)
    print(f"worst max|diff| of the Triton kernels vs eager: {worst:.3g}")


if __name__ == "__main__":
    main()
