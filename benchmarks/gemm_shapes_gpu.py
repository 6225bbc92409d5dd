#!/usr/bin/env python
"""Each linear layer of a model's decode step timed alone at the step's batch: which shape runs far from the
machine's matmul rate, under cuBLAS and cuBLASLt (issue #27: why Qwen2.5-7B's decode step trails Qwen3-8B's).

    python benchmarks/gemm_shapes_gpu.py --models configs/Qwen2.5-7B configs/Qwen3-8B --batch 256
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness.ceilings import time_op  # noqa: E402
from benchmarks.harness.output import md_table  # noqa: E402

L2_FLUSH_BYTES = 256 << 20


def median_ms(op, reps: int) -> float:
    return 1e3 * statistics.median(time_op(op, "cuda", reps, 5))


def linears(cfg: dict) -> list[tuple[str, int, int, bool, int]]:
    """(name, N, K, bias, count a step) of each matmul of one decode step."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    d = cfg.get("head_dim") or h // heads
    layers, inter = cfg["num_hidden_layers"], cfg["intermediate_size"]
    bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias"))
    return [("qkv_proj", (heads + 2 * kv) * d, h, bias, layers), ("o_proj", h, heads * d, False, layers),
            ("gate_up_proj", 2 * inter, h, False, layers), ("down_proj", h, inter, False, layers),
            ("lm_head", cfg["vocab_size"], h, False, 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["configs/Qwen2.5-7B", "configs/Qwen3-8B"])
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    rows, totals = [], []
    for model in args.models:
        cfg = json.loads((REPO / model / "config.json").read_text())
        for m in args.batch:
            step = {"cublas": 0.0, "cublaslt": 0.0}
            for name, n, k, bias, count in linears(cfg):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                # copies cycled so that no rep finds its weight in the 50 MB L2 (a decode step never does)
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                      for _ in range(max(2, -(-L2_FLUSH_BYTES // (2 * n * k))))]
                turn = itertools.cycle(ws)
                b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
                cells = []
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    ms = median_ms(lambda: F.linear(x, next(turn), b), args.reps)
                    step[lib] += ms * count
                    base = ms if lib == "cublas" else base
                    cells += [f"{ms * 1e3:.1f}", f"{2 * m * n * k / ms / 1e9:.0f}"]
                if b is not None:  # the bias as its own add: is the fused epilogue the slow part?
                    torch.backends.cuda.preferred_blas_library("cublas")
                    ms = median_ms(lambda: F.linear(x, next(turn)) + b, args.reps)
                    cells.append(f"{ms * 1e3:.1f}")
                else:
                    cells.append("")
                rows.append([Path(model).name, m, f"{name} {m}x{k} @ {k}x{n}" + (" +bias" if bias else ""),
                             count, *cells, f"{n * k * 2 / base / 1e6:.0f}"])
                del x, ws, turn, b
            totals.append([Path(model).name, m, f"{step['cublas']:.2f}", f"{step['cublaslt']:.2f}"])
    torch.backends.cuda.preferred_blas_library("cublas")
    print(md_table(["model", "M", "matmul", "a step", "cuBLAS us", "TFLOP/s", "cuBLASLt us", "TFLOP/s",
                    "mm + add us", "weight GB/s"], rows))
    print()
    print(md_table(["model", "M", "cuBLAS ms a step", "cuBLASLt ms a step"], totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
