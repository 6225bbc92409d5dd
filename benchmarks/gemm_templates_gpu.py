#!/usr/bin/env python
"""Decode GEMMs at batch 64-256: cuBLAS against what Inductor's max-autotune picks per shape (issue #13).

8B's decode GEMMs take 1.48 s over their weights' read time on the default bench (run 41); at batch 128-256 they
are compute-bound and cuBLAS runs them at ~550 TFLOP/s. This times every projection of the chosen models at the
chosen batch sizes, bf16, three ways: torch's linear (cuBLAS), Inductor's autotuned mm (Triton templates and ATen
in the race; the winner is printed by Inductor itself), and the same with ATen left out (the best template alone),
all under CUDA graphs with L2 flushed between replays (every weight read from HBM, as in a decode step).

    python benchmarks/gemm_templates_gpu.py --models 8B --batches 128 256
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.graph_capture import capture  # noqa: E402

FLUSH_BYTES = 256 << 20


def projections(model_dir: Path) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one layer's decode GEMMs (gate and up stacked, as the engine runs them)."""
    c = json.loads((model_dir / "config.json").read_text())
    h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, c["num_attention_heads"] * d), "gate_up": (2 * c["intermediate_size"], h),
            "down": (h, c["intermediate_size"])}


def graph_ms(fn, flush: torch.Tensor, reps: int) -> float:
    """ms of one call of fn, replayed in a CUDA graph after an L2 flush (the flush's own time subtracted)."""
    def timed(body) -> float:
        g = capture(body)
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / reps)
        return best

    def with_flush() -> None:
        flush.zero_()
        fn()

    return timed(with_flush) - timed(flush.zero_)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["8B"])
    ap.add_argument("--batches", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--triton-only", action="store_true", help="also race the templates alone (ATen left out)")
    args = ap.parse_args()
    import torch._inductor.config as inductor_config
    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'model':>5} {'shape':>8} {'M':>4} {'N x K':>13} {'cublas ms':>9} {'TF/s':>5} {'autotune':>9} {'TF/s':>5}"
          + (f" {'triton only':>9} {'TF/s':>5}" if args.triton_only else "") + f" {'max|diff|':>9}")
    totals: dict[tuple[str, int], list[float]] = {}
    for model in args.models:
        for m in args.batches:
            for name, (n, k) in projections(REPO / "configs" / f"Qwen3-{model}").items():
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                ref = F.linear(x, w)
                row = [graph_ms(lambda: F.linear(x, w), flush, args.reps)]
                outs = []
                backends = ["ATEN,TRITON"] + (["TRITON"] if args.triton_only else [])
                for b in backends:
                    inductor_config.max_autotune_gemm_backends = b
                    torch._dynamo.reset()
                    t0 = time.perf_counter()
                    f = torch.compile(lambda a, b_: F.linear(a, b_), mode="max-autotune-no-cudagraphs", dynamic=False)
                    outs.append(f(x, w))
                    print(f"  ({b}: compiled and tuned in {time.perf_counter() - t0:.0f} s)", flush=True)
                    row.append(graph_ms(lambda: f(x, w), flush, args.reps))
                flops = 2 * m * n * k
                cells = " ".join(f"{ms:>9.4f} {flops / ms / 1e9:>5.0f}" for ms in row)
                err = max((o.float() - ref.float()).abs().max().item() for o in outs)
                print(f"{model:>5} {name:>8} {m:>4} {n:>6}x{k:<6} {cells} {err:>9.2e}", flush=True)
                acc = totals.setdefault((model, m), [0.0] * len(row))
                for i, v in enumerate(row):
                    acc[i] += v
    print("\nper layer (sum of the four projections), ms: cublas / autotune" + (" / triton only" if args.triton_only else ""))
    for (model, m), v in totals.items():
        print(f"{model:>5} M={m:<4} " + " / ".join(f"{x:.4f}" for x in v))


if __name__ == "__main__":
    main()
