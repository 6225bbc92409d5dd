#!/usr/bin/env python
"""Where start-up and a prefill step spend their time (diagnostics for issues #12 and #13).

One process: imports timed one by one, ``LLM(...)`` under cProfile (the engine's own phase clock and the
functions with the most cumulative time), then optionally a prefill-only generate under the CUDA profiler
(kernel groups, the top kernels, and the GEMMs' achieved TFLOP/s). Run it twice on a fresh machine to see
the cold and the warm start-up.

    python benchmarks/startup_profile_gpu.py --prefill 40x570          # the GPU run
    python benchmarks/startup_profile_gpu.py --device cpu --model examples/tiny-qwen3 --prefill 4x32
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

t_start = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def timed_import(name: str) -> float:
    t = time.perf_counter()
    __import__(name)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/Qwen3-0.6B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill", default="", help="NxL: N prompts of L random tokens, max_tokens=1, profiled")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--pstats", default="", help="write the start-up profile here")
    args = ap.parse_args()
    imports = {m: timed_import(m) for m in ("torch", "triton", "transformers", "llmcli")}
    print("imports s: " + ", ".join(f"{k} {v:.2f}" for k, v in imports.items()), flush=True)
    from llmcli import LLM, SamplingParams

    knobs = dict(load_format="dummy", device=args.device, generation_config="ignore")
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    llm = LLM(args.model, **knobs)
    prof.disable()
    startup = time.perf_counter() - t
    print(f"LLM() {startup:.2f} s; phases {llm.engine.startup_s}; process so far {time.perf_counter() - t_start:.2f} s")
    heavy = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor",
             "torch.onnx", "transformers.generation.utils", "sklearn")
    print("heavy modules imported: " + (", ".join(m for m in heavy if m in sys.modules) or "none"))
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(20)
    print(s.getvalue())
    if args.pstats:
        stats.dump_stats(args.pstats)
    if args.prefill:
        prefill_profile(llm, SamplingParams, args)
    llm.shutdown()


def prefill_profile(llm, SamplingParams, args) -> None:  # noqa: N803
    import random

    import torch

    n, length = (int(x) for x in args.prefill.split("x"))
    vocab = llm.engine.config.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    def batch():
        return [[rng.randrange(vocab // 10, vocab - vocab // 10) for _ in range(length)] for _ in range(n)]
    llm.generate(batch(), params)  # warm
    if args.device != "cuda":
        t = time.perf_counter()
        llm.generate(batch(), params)
        print(f"prefill {n}x{length}: {time.perf_counter() - t:.3f} s")
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = batch()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    prompts = batch()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if evt.device_type == DeviceType.CUDA and evt.self_device_time_total > 0:
            rows.append((evt.self_device_time_total / 1e3, evt.count, evt.key[:110]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    tokens = n * length
    hf = llm.engine.config.hf_config
    params_ne = sum(p.numel() for name, p in llm.engine.model_runner.model.named_parameters()
                    if "embed" not in name and "lm_head" not in name) if hasattr(llm.engine, "model_runner") else 0
    print(f"prefill {n}x{length} = {tokens} tokens: wall {wall * 1e3:.1f} ms, device kernels {total:.1f} ms "
          f"({tokens / wall:,.0f} tok/s); non-embedding params {params_ne / 1e6:.1f} M")
    gemm_ms = sum(r[0] for r in rows if any(k in r[2] for k in ("gemm", "nvjet", "cutlass", "sm90_", "cublas")))
    if params_ne and gemm_ms:
        print(f"GEMMs {gemm_ms:.1f} ms: {2 * params_ne * tokens / (gemm_ms / 1e3) / 1e12:.0f} TFLOP/s achieved")
    attn_flops = 4 * hf.num_hidden_layers * hf.num_attention_heads * 128 * n * length * length / 2
    print(f"attention FLOPs {attn_flops / 1e12:.2f} TFLOP (causal)")
    print(f"{'ms':>9} {'calls':>6}  kernel")
    for ms, count, name in rows[:30]:
        print(f"{ms:9.2f} {count:6d}  {name}")


if __name__ == "__main__":
    main()
