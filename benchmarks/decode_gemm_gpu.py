#!/usr/bin/env python
"""Decode GEMMs on the GPU: llmcli's split-K Triton thin GEMM against cuBLAS, with and without PDL.

Correctness first: every projection shape of the chosen models at decode batch sizes, bfloat16, against
torch's matmul (cuBLAS): worst relative error, and whether two launches give the same bits (split-K sums its
partials in a fixed order). Then speed: one CUDA graph holding a model's whole decode GEMM chain (per layer
qkv, o, gate/up with SiLU-and-mul, down; every layer its own weights, so L2 cannot keep them between replays),
replayed back to back; milliseconds per chain and the weights' GB/s. Rows:

- ``cublas``: torch's linear for every projection, then llmcli's Triton SiLU-and-mul kernel (today's default);
- ``cublaslt``: the same with torch told to prefer cuBLASLt (what ``speed_gpu.py``'s ``blas=cublaslt`` variant runs
  end to end; +0.7% on the 0.6B default bench in run 23, 8B not measured);
- ``triton``: the Triton GEMMs (SiLU-and-mul fused into the gate/up one);
- ``triton+pdl``: the same with programmatic dependent launch (weights prefetched to L2 before the wait);
- sweeps of the Triton kernel's tiles and split-K, with PDL.

    python benchmarks/decode_gemm_gpu.py --models configs/Qwen3-0.6B configs/Qwen3-8B --batches 1 16 64 256
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from llmcli.kernels import pdl  # noqa: E402
from llmcli.kernels.triton_elementwise import silu_and_mul  # noqa: E402
from llmcli.kernels.triton_gemm import DEFAULT_TUNING, GemmTuning, linear, silu_mul_linear  # noqa: E402

VARIANTS: dict[str, tuple[bool, GemmTuning | None]] = {  # name -> (pdl, tuning; None: torch's linear)
    "cublas": (False, None),
    "cublaslt": (False, None),  # torch's linear inside preferring("cublaslt")
    "triton": (False, DEFAULT_TUNING),
    "triton+pdl": (True, DEFAULT_TUNING),
    "triton+pdl, no prefetch": (True, replace(DEFAULT_TUNING, prefetch=False)),
    "triton+pdl, no split": (True, replace(DEFAULT_TUNING, programs_per_sm=0)),
    "triton+pdl, block_n 32": (True, replace(DEFAULT_TUNING, block_n=32)),
    "triton+pdl, block_n 32, no split": (True, replace(DEFAULT_TUNING, block_n=32, programs_per_sm=0)),
    "triton+pdl, block_n 32, block_k 256": (True, replace(DEFAULT_TUNING, block_n=32, block_k=256)),
    # batch 128-256 in one or two row tiles, so each weight tile is read once or twice (8B, run 48)
    "triton, block_m 128": (False, replace(DEFAULT_TUNING, max_block_m=128)),
    "triton, block_m 128, 8 warps": (False, replace(DEFAULT_TUNING, max_block_m=128, num_warps=8)),
    "triton, block_m 128, block_n 128, 8 warps": (False, replace(DEFAULT_TUNING, max_block_m=128, block_n=128,
                                                                 num_warps=8)),
    "triton, block_m 256, 8 warps": (False, replace(DEFAULT_TUNING, max_block_m=256, num_warps=8)),
    "triton, block_m 256, 8 warps, block_k 64": (False, replace(DEFAULT_TUNING, max_block_m=256, num_warps=8,
                                                                block_k=64)),
}


@contextlib.contextmanager
def preferring(library: str) -> Iterator[None]:
    """torch's BLAS front end for the block (a CUDA graph keeps the library it was captured with)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def shapes_of(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(hidden=cfg["hidden_size"], inter=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                q=cfg["num_attention_heads"] * head_dim, kv=cfg["num_key_value_heads"] * head_dim)


def layer_weights(s: dict[str, int], dev: torch.device, scale: float = 0.02) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) * scale).to(torch.bfloat16)
    return [dict(qkv=w(s["q"] + 2 * s["kv"], s["hidden"]), o=w(s["hidden"], s["q"]),
                 gate_up=w(2 * s["inter"], s["hidden"]), down=w(s["hidden"], s["inter"])) for _ in range(s["layers"])]


def chain(layers: list[dict[str, torch.Tensor]], xs: dict[str, torch.Tensor], tuning: GemmTuning | None) -> None:
    for lw in layers:
        if tuning is None:
            F.linear(xs["h"], lw["qkv"])
            F.linear(xs["attn"], lw["o"])
            silu_and_mul(F.linear(xs["h"], lw["gate_up"]))
            F.linear(xs["mlp"], lw["down"])
        else:
            linear(xs["h"], lw["qkv"], tuning)
            linear(xs["attn"], lw["o"], tuning)
            silu_mul_linear(xs["h"], lw["gate_up"], tuning)
            linear(xs["mlp"], lw["down"], tuning)


def cublas_projection(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One projection as the engine's default runs it (gate/up with its SiLU-and-mul)."""
    y = F.linear(x, w)
    return silu_and_mul(y) if name == "gate_up" else y


def triton_projection(name: str, x: torch.Tensor, w: torch.Tensor, tuning: GemmTuning = DEFAULT_TUNING,
                      ) -> torch.Tensor:
    """The same projection through llmcli's thin GEMM (gate/up with SiLU-and-mul as its epilogue)."""
    return silu_mul_linear(x, w, tuning) if name == "gate_up" else linear(x, w, tuning)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-9)).item()


def check(layers: list[dict[str, torch.Tensor]], s: dict[str, int], batches: list[int], dev: torch.device) -> list[str]:
    """Worst relative error against cuBLAS and determinism, per shape and batch; returns failures."""
    failures = []
    print("| projection | batch | rel err (PDL off / on) | same bits twice |")
    print("|---|---:|---|---|")
    lw = layers[0]
    for m in batches:
        xs = {"h": torch.randn(m, s["hidden"], device=dev).to(torch.bfloat16),
              "attn": torch.randn(m, s["q"], device=dev).to(torch.bfloat16),
              "mlp": torch.randn(m, s["inter"], device=dev).to(torch.bfloat16)}
        for name, x_key in (("qkv", "h"), ("o", "attn"), ("gate_up", "h"), ("down", "mlp")):
            x, w = xs[x_key], lw[name]
            ref = cublas_projection(name, x, w)
            errs, same = [], True
            for on in (False, True):
                pdl.enable(on, dev)
                a, b = triton_projection(name, x, w), triton_projection(name, x, w)
                torch.cuda.synchronize()
                errs.append(rel_err(a, ref))
                same = same and torch.equal(a, b)
            pdl.enable(False, dev)
            ok = max(errs) < 2e-2 and same
            if not ok:
                failures.append(f"{name} m={m}: rel err {errs}, same bits {same}")
            print(f"| {name} | {m} | {errs[0]:.2e} / {errs[1]:.2e} | {'yes' if same else 'NO'} |")
    return failures


def variant_error(layer: dict[str, torch.Tensor], s: dict[str, int], m: int, dev: torch.device,
                  tuning: GemmTuning) -> float:
    """Worst relative error of a variant's qkv, o, gate/up + SiLU-and-mul and down against cuBLAS at batch m."""
    worst = 0.0
    for name, width in (("qkv", "hidden"), ("o", "q"), ("gate_up", "hidden"), ("down", "inter")):
        x = torch.randn(m, s[width], device=dev).to(torch.bfloat16)
        got = triton_projection(name, x, layer[name], tuning)
        worst = max(worst, rel_err(got, cublas_projection(name, x, layer[name])))
    return worst


def time_chain(layers: list[dict[str, torch.Tensor]], s: dict[str, int], m: int, dev: torch.device,
               tuning: GemmTuning | None, use_pdl: bool, reps: int) -> float:
    pdl.enable(use_pdl, dev)
    xs = {"h": torch.randn(m, s["hidden"], device=dev).to(torch.bfloat16),
          "attn": torch.randn(m, s["q"], device=dev).to(torch.bfloat16),
          "mlp": torch.randn(m, s["inter"], device=dev).to(torch.bfloat16)}
    chain(layers, xs, tuning)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(layers, xs, tuning)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    pdl.enable(False, dev)
    del graph
    return start.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["configs/Qwen3-0.6B", "configs/Qwen3-8B"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    if not pdl.supported(dev):
        print("this GPU cannot use PDL (compute capability < 9.0): the +pdl rows run without it")
    failures: list[str] = []
    for model in args.models:
        s = shapes_of(REPO / model)
        torch.manual_seed(0)
        layers = layer_weights(s, dev)
        weight_bytes = sum(w.numel() * w.element_size() for lw in layers for w in lw.values())
        print(f"\n## {Path(model).name}: {s['layers']} layers, decode GEMM weights {weight_bytes / 1e9:.2f} GB\n")
        failures += check(layers, s, args.batches, dev)
        print(f"\nms per decode GEMM chain (one CUDA graph, {args.reps} replays); GB/s of weights in brackets\n")
        print("| variant | " + " | ".join(f"batch {m}" for m in args.batches) + " |")
        print("|---|" + "---:|" * len(args.batches))
        for name in args.variants:
            use_pdl, tuning = VARIANTS[name]
            cells = []
            for m in args.batches:
                try:
                    err = 0.0 if tuning is None else variant_error(layers[0], s, m, dev, tuning)
                    if err > 2e-2:
                        failures.append(f"{model} {name} batch {m}: relative error {err:.2e} against cuBLAS")
                        cells.append(f"WRONG ({err:.1e})")
                        continue
                    with preferring("cublaslt" if name == "cublaslt" else "cublas"):
                        ms = time_chain(layers, s, m, dev, tuning, use_pdl, args.reps)
                    cells.append(f"{ms:.3f} ({weight_bytes / ms / 1e6:,.0f})")
                except Exception as exc:  # one variant failing must not hide the others
                    failures.append(f"{model} {name} batch {m}: {type(exc).__name__}: {exc}")
                    cells.append("FAILED")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        del layers
        torch.cuda.empty_cache()
    if failures:
        print("\nFAILED:\n" + "\n".join(failures))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
