#!/usr/bin/env python
"""Where the device time of a run's first steps goes, kernel by kernel: the default workload (``llmcli bench``'s
requests) on one published config with dummy weights, steps ``--skip`` to ``--skip + --steps`` under the torch
profiler. Mixed and prefill steps run eagerly, so every kernel shows (decode steps replay CUDA graphs: their
kernels are in ``bench_vs_hf.py``'s decode breakdown instead).

    python benchmarks/step_profile.py --model configs/Qwen3.6-27B --skip 1 --steps 4
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from benchmarks.harness.decode_profile import kernel_group  # noqa: E402
from benchmarks.harness.workload import add_workload_args, make_workload, model_facts  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--skip", type=int, default=1, help="steps run before the profiled ones")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: its own)")
    p.add_argument("--no-prefix-caching", action="store_true", help="the engine without its prefix cache")
    p.add_argument("--host-steps", type=int, default=0,
                   help="steps run after the profiled ones under cProfile: where the host's time goes")
    add_workload_args(p)
    args = p.parse_args(argv)

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from llmcli import LLM, SamplingParams

    facts = model_facts(Path(args.model))
    prompts, outputs, _ = make_workload(args, facts)
    kw = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    llm = LLM(args.model, load_format="dummy", seed=0, **kw)
    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(prompt, SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True),
                           request_id=str(i))
    plans = []
    runner = engine.model_runner
    original = runner.launch

    def recording_launch(plan, *rest):
        plans.append(plan)
        return original(plan, *rest)

    runner.launch = recording_launch
    for _ in range(args.skip):
        engine.step()
    sync()
    first = len(plans)
    walls, allocs = [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            walls.append(timed_step(engine, allocs))
    print_steps(plans[first:first + args.steps], walls, allocs, args.skip)
    kernels = [(e.self_device_time_total, e.count, e.key) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(k[0] for k in kernels) or 1.0
    groups: dict[str, float] = {}
    for us, _, name in kernels:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + us
    print(f"\ndevice time over {args.steps} steps: {total / 1e3:.1f} ms")
    print("| kernel group | ms | share |\n|---|---:|---:|")
    for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {us / 1e3:.2f} | {us / total:.1%} |")
    print("\n| kernel | calls | ms | share |\n|---|---:|---:|---:|")
    for us, count, name in sorted(kernels, reverse=True)[:args.top]:
        print(f"| {name[:90]} | {count} | {us / 1e3:.2f} | {us / total:.1%} |")
    if args.host_steps:
        host_profile(engine, plans, args.host_steps, args.skip + args.steps, args.top)
    del runner.launch
    llm.shutdown()
    return 0


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def timed_step(engine, allocs: list) -> float:
    """One step, synchronised on both sides (its wall time whole; this serialises the host and the device);
    appends the caching allocator's device mallocs, frees and retries in it to ``allocs``."""
    before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    sync()
    t = time.perf_counter()
    engine.step()
    sync()
    ms = 1e3 * (time.perf_counter() - t)
    after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    allocs.append(tuple(after.get(k, 0) - before.get(k, 0) for k in ALLOC_KEYS))
    return ms


def print_steps(plans, walls, allocs, first: int) -> None:
    print("| step | kind | entries | tokens | snapshot writes | reads | wall ms (synchronised) | cudaMalloc | "
          "cudaFree | alloc retries |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (plan, ms, (mallocs, frees, retries)) in enumerate(zip(plans, walls, allocs)):
        kind = "decode" if not plan.is_prefill else ("mixed" if (plan.scheduled == 1).any() else "prefill")
        print(f"| {first + i} | {kind} | {plan.num_entries} | {plan.num_tokens} | {len(plan.state_writes)} | "
              f"{len(plan.state_reads)} | {ms:.1f} | {mallocs} | {frees} | {retries} |")


def host_profile(engine, plans: list, steps: int, first: int, top: int) -> None:
    """``steps`` more steps under cProfile (no torch profiler): the host functions taking the most time, by
    their own time and with their callees."""
    import cProfile
    import io
    import pstats

    walls, allocs, start = [], [], len(plans)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        walls.append(timed_step(engine, allocs))
    prof.disable()
    print(f"\n## host profile of steps {first} to {first + steps} (cProfile)\n")
    print_steps(plans[start:], walls, allocs, first)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        print(f"\n### by {order}\n```")
        print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip())[-12000:])
        print("```")


if __name__ == "__main__":
    sys.exit(main())
