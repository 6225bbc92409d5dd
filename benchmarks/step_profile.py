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
    add_workload_args(p)
    args = p.parse_args(argv)

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from llmcli import LLM, SamplingParams

    facts = model_facts(Path(args.model))
    prompts, outputs, _ = make_workload(args, facts)
    kw = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
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
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            sync()  # each step's wall time whole (this serialises the host and the device)
            walls.append(1e3 * (time.perf_counter() - t))
    del runner.launch
    print("| step | kind | entries | tokens | snapshot writes | reads | wall ms (synchronised) |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for i, (plan, ms) in enumerate(zip(plans[first:], walls)):
        kind = "decode" if not plan.is_prefill else ("mixed" if (plan.scheduled == 1).any() else "prefill")
        print(f"| {args.skip + i} | {kind} | {plan.num_entries} | {plan.num_tokens} | {len(plan.state_writes)} | "
              f"{len(plan.state_reads)} | {ms:.1f} |")
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
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
