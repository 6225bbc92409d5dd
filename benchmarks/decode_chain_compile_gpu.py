#!/usr/bin/env python
"""The decode step's kernels other than attention: llmcli's against Inductor's fused ones (issue #13).

On Qwen3-0.6B the decode GEMMs and elementwise kernels cost ~0.9 s over the bound on the default bench (run 41):
some 250 small kernels a step, each a few microseconds of bytes, so the chain is latency-bound (run 33: cuBLAS and
llmcli's Triton GEMMs alike reach ~1 TB/s on it). Fusing the norms and SiLU-and-mul into the GEMMs would remove
half of those kernels, but cuBLAS cannot take them and our Triton GEMMs are slower than cuBLAS. Before anyone writes
fused GEMMs, this measures what fusion buys: the model's forward at batch B with attention left out (the layer
gets q back as its output: no KV read, no store), captured in one CUDA graph and replayed, three ways:

- ``engine``: the model as the engine runs it (cuBLAS GEMMs, llmcli's Triton elementwise kernels);
- ``inductor``: the same model's eager code compiled by ``torch.compile`` (cuBLAS GEMMs, Inductor's fused
  elementwise kernels);
- ``autotune``: the same with ``mode="max-autotune-no-cudagraphs"``: Triton GEMM templates race cuBLAS per shape,
  with the norms, rotary and SiLU-and-mul fused into their prologues and epilogues where Inductor can.

Printed per model and batch: ms per forward (median replay), its GB/s of weights, kernels per forward (profiled on
one call outside the graph), and each variant's largest difference from ``engine`` relative to the output's
largest value (bf16: different fusion rounds differently; above ``--tol`` the row is marked and the exit
status is 1). The engine's decode step adds attention, the LM head and the sampler to this.

    python benchmarks/decode_chain_compile_gpu.py                                 # 0.6B, batch 64/128/256
    python benchmarks/decode_chain_compile_gpu.py --models configs/Qwen3-8B --batches 128 256
    python benchmarks/decode_chain_compile_gpu.py --device cpu --tiny             # smoke test, ~1 minute
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import llmcli.layers.compile as layer_compile  # noqa: E402
from benchmarks.harness.graph_capture import capture  # noqa: E402
from llmcli.kernels.backend import AttentionBackend  # noqa: E402
from llmcli.models import build_model  # noqa: E402
from llmcli.models.loader import load_dummy  # noqa: E402
from llmcli.models import head_dim_of  # noqa: E402

VARIANTS = ("engine", "inductor", "autotune")
COMPILE_MODES = {"inductor": "default", "autotune": "max-autotune-no-cudagraphs"}


class PassThrough(AttentionBackend):
    """Attention left out: the layer's q comes back as its attention output (nothing read, nothing stored)."""

    name = "pass-through"

    def forward(self, q, k, v, k_cache, v_cache, qk_norm=None):
        return q


def tiny_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                       architectures=["Qwen3ForCausalLM"])


def build(hf_config: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The engine's model (as ``ModelRunner._build_model`` makes it) on the pass-through backend, dummy weights."""
    head_dim = head_dim_of(hf_config)
    backend = PassThrough(hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim,
                          head_dim ** -0.5, 256)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(hf_config, backend)
    finally:
        torch.set_default_dtype(default)
    load_dummy(model, seed=0)
    return model.eval()


def set_elementwise(mode: str) -> None:
    """The model's elementwise functions as Triton kernels ("triton") or as their eager torch code ("eager", what
    Inductor traces). Patched where the wrappers look it up, so tracing sees a constant, not an env lookup."""
    layer_compile.elementwise_mode = lambda: mode


def count_kernels(fn: Callable[[], Any]) -> int | None:
    """Device kernels one call launches (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median ms of one forward: replays of a CUDA graph of ``fn`` on the GPU, plain calls on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)
    graph = capture(fn, warmups=3)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_model(hf_config: Any, name: str, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> list[dict[str, Any]]:
    model = build(hf_config, device, dtype)
    layer_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                      if ".layers." in n)  # what a forward reads of weights (no embedding gather, no LM head)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for batch in args.batches:
        ids = torch.randint(0, hf_config.vocab_size, (batch,), generator=gen).to(device)
        positions = torch.randint(100, 2048, (batch,), generator=gen).to(device)
        reference = None
        for variant in args.variants:
            torch._dynamo.reset()
            set_elementwise("triton" if variant == "engine" else "eager")
            if variant == "engine":
                fn = model
            else:
                fn = torch.compile(model, mode=COMPILE_MODES[variant], dynamic=False, fullgraph=True)
            try:
                with torch.inference_mode():
                    started = time.perf_counter()
                    out = fn(ids, positions)  # the compile happens here
                    compile_s = time.perf_counter() - started
                    if variant == "engine":
                        reference = out.float()
                    err = None if reference is None else \
                        float((out.float() - reference).abs().max() / reference.abs().max().clamp(min=1e-6))
                    kernels = count_kernels(lambda: fn(ids, positions))
                    ms = time_ms(lambda: fn(ids, positions), device, args.reps)
            except Exception as exc:  # noqa: BLE001 - one variant failing to compile must not cost the others
                print(f"{name} batch {batch} {variant}: FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"model": name, "batch": batch, "variant": variant, "failed": str(exc)[:300], "bad": True})
                continue
            row = {"model": name, "batch": batch, "variant": variant, "ms": ms, "compile_s": compile_s,
                   "weights_gb_s": layer_bytes / (ms / 1000) / 1e9, "kernels": kernels, "rel_err": err,
                   "bad": err is not None and err > args.tol}
            rows.append(row)
            print(f"{name} batch {batch} {variant}: {ms:.3f} ms, {row['weights_gb_s']:,.0f} GB/s of weights, "
                  f"{kernels} kernels, rel err {err if err is None else f'{err:.2e}'}, first call {compile_s:.1f} s",
                  flush=True)
    set_elementwise("triton")
    del model
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=[str(REPO / "configs" / "Qwen3-0.6B")],
                   help="model folders with a config.json (dummy weights)")
    p.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--reps", type=int, default=50, help="timed replays per row")
    p.add_argument("--tol", type=float, default=0.05,
                   help="largest |variant - engine| / max |engine| before a row is marked (bf16)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a two-layer toy config instead of --models (smoke test)")
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.variants = [v for v in args.variants if v != "autotune"]  # Inductor's GEMM templates are GPU-only
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(16, os.cpu_count() or 1)))
    if args.tiny:
        models = [("tiny", tiny_config())]
    else:
        from transformers import AutoConfig

        models = [(Path(m).name, AutoConfig.from_pretrained(m)) for m in args.models]
    rows: list[dict[str, Any]] = []
    for name, hf_config in models:
        rows += run_model(hf_config, name, args, device, dtype)
    print("\n| model | batch | variant | ms / forward | GB/s of weights | kernels | rel err vs engine | first call s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['model']} | {r['batch']} | {r['variant']} | FAILED | | | | |")
            continue
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}" + (" **over --tol**" if r["bad"] else "")
        print(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['ms']:.3f} | {r['weights_gb_s']:,.0f} | "
              f"{'' if r['kernels'] is None else r['kernels']} | {err} | {r['compile_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["bad"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
