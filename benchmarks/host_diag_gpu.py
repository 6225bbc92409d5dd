#!/usr/bin/env python
"""Why a decode step's host work takes ~3x longer in a real GPU run than around a stub forward (issue #13).

One Qwen3-0.6B engine (dummy weights) runs the default bench workload several times, each under one setting:
``base``; ``threads1`` (torch.set_num_threads(1)); ``nogc`` (gc.freeze() then gc.disable() for the run).
For each run it prints, at the largest decode batch: the median wall ms of each host phase and the main
thread's CPU ms in it (a phase whose CPU time is well under its wall time was descheduled: another thread
held the GIL or the core), the main thread's voluntary / involuntary context switches per decode step, and
every thread of the process that used more than 2% of the run's wall time in CPU (name from /proc).

Then llmcli's decode step at batches 256, 64 and 16 (context ~800): CUDA-graph replay time of the forward
plus sampler against the sum of its kernels' device time (the same step launched eagerly under the
profiler), i.e. how much of the step is launch gaps and kernel tails rather than kernels. Last, one mixed step
shaped like the prefill-heavy preset's (464 sequences decoding, 16 new 570-token prompts, three times): its kernels by group.

    python benchmarks/host_diag_gpu.py               # GPU: ~2 minutes
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.output import say  # noqa: E402
from benchmarks.harness.workload import model_facts  # noqa: E402
from llmcli.cli.bench import Workload, make_requests  # noqa: E402
from llmcli.engine import step_timer  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def threads_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds so far), from /proc."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK)
    return out


def switches(tid: int) -> tuple[int, int]:
    vol = invol = 0
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol = int(line.split()[1])
    return vol, invol


class CpuPhases:
    """Per step: wall and main-thread CPU seconds of every step-timer phase (and of the scheduler's calls)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def install(self, engine: Any) -> None:
        phases = self

        class Phase:
            __slots__ = ("name", "w", "c", "inner")

            def __init__(self, timer: Any, name: str) -> None:
                self.name, self.inner = name, step_timer._Phase(timer, name)

            def __enter__(self) -> None:
                self.inner.__enter__()
                self.w, self.c = time.perf_counter(), time.thread_time()

            def __exit__(self, *exc: object) -> None:
                phases.wall[self.name] += time.perf_counter() - self.w
                phases.cpu[self.name] += time.thread_time() - self.c
                self.inner.__exit__(*exc)

        engine.step_timer.phase = lambda name: Phase(engine.step_timer, name)
        sched = engine.scheduler
        original = sched.schedule

        def schedule() -> Any:
            w, c = time.perf_counter(), time.thread_time()
            out = original()
            phases.wall["schedule(call)"] += time.perf_counter() - w
            phases.cpu["schedule(call)"] += time.thread_time() - c
            return out

        sched.schedule = schedule

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        wall, cpu = dict(self.wall), dict(self.cpu)
        self.wall.clear()
        self.cpu.clear()
        return wall, cpu


def run_once(llm: Any, engine: Any, phases: CpuPhases, prompts: list[list[int]], outs: list[int],
             setting: str) -> None:
    from llmcli import SamplingParams

    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, top_p=1.0, top_k=-1, min_p=0.0,
                             repetition_penalty=1.0) for o in outs]
    engine.scheduler.block_manager.reset_prefix_cache()
    per_step: list[tuple[int, dict[str, float], dict[str, float], float, float]] = []
    original = engine.step

    def step() -> Any:
        w, c = time.perf_counter(), time.thread_time()
        out = original()
        wall, cpu = phases.take()
        batch = len(engine.scheduler.running)
        per_step.append((batch, wall, cpu, time.perf_counter() - w, time.thread_time() - c))
        return out

    engine.step = step
    main_tid = threading_native_id()
    before_threads, before_sw = threads_cpu(), switches(main_tid)
    if setting == "threads1":
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    if setting == "nogc":
        gc.collect()
        gc.freeze()
        gc.disable()
    sync()
    start = time.perf_counter()
    try:
        llm.generate(prompts, params)
        sync()
    finally:
        wall_s = time.perf_counter() - start
        del engine.step
        if setting == "threads1":
            torch.set_num_threads(saved_threads)
        if setting == "nogc":
            gc.enable()
            gc.unfreeze()
    after_threads, after_sw = threads_cpu(), switches(main_tid)
    top = max(b for b, *_ in per_step)
    at = [s for s in per_step if s[0] == top][1:]  # the first step at that batch is the last prefill's
    names = sorted({n for s in at for n in s[1]})
    say(f"\n{setting}: wall {wall_s:.2f} s, {len(per_step)} steps, {len(at)} at batch {top}; per step at that batch "
        "(median ms): phase wall / main-thread CPU")
    say("  " + ", ".join(f"{n} {1e3 * statistics.median(s[1].get(n, 0) for s in at):.3f}/"
                         f"{1e3 * statistics.median(s[2].get(n, 0) for s in at):.3f}" for n in names))
    say(f"  whole step: wall {1e3 * statistics.median(s[3] for s in at):.3f} ms, main-thread CPU "
        f"{1e3 * statistics.median(s[4] for s in at):.3f} ms")
    steps = len(per_step)
    say(f"  main thread context switches per step: voluntary {(after_sw[0] - before_sw[0]) / steps:.2f}, "
        f"involuntary {(after_sw[1] - before_sw[1]) / steps:.2f}")
    busy = []
    for tid, (name, secs) in after_threads.items():
        used = secs - before_threads.get(tid, (name, 0.0))[1]
        if used > 0.02 * wall_s:
            busy.append((used, tid, name))
    say("  threads over 2% CPU: " + ", ".join(f"{name}[{tid}{'*' if tid == main_tid else ''}] "
                                              f"{100 * used / wall_s:.0f}%" for used, tid, name in sorted(busy,
                                                                                                     reverse=True)))


def threading_native_id() -> int:
    import threading

    return threading.get_native_id()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def breakdown(llm: Any, facts: dict[str, Any], batches: list[int], context: int, device: str) -> None:
    from benchmarks.harness.decode_profile import decode_breakdown
    from benchmarks.harness.report import Report

    report = Report(None)
    say("\ndecode step by batch: graph replay of forward+sample vs the sum of its kernels (eager, profiler)")
    say("| batch | context | graph forward+sample ms | kernels ms | gaps ms | kernels | step wall ms | groups ms |")
    say("|---:|---:|---:|---:|---:|---:|---:|---|")
    for batch in batches:
        args = SimpleNamespace(breakdown_batch=batch, breakdown_context=context, breakdown_steps=30,
                               breakdown_warmup=5, seed=0, temperature=0.6, gpu_reps=20, device=device)
        decode_breakdown(args, report, llm, facts, context)
        r = report.data["decode_breakdown"][facts["name"]]
        groups = r.get("kernel_groups") or {}
        kernels_ms = sum(g["us"] for g in groups.values()) / 1e3
        count = sum(g["kernels"] for g in groups.values())
        graph_ms = r.get("gpu_forward_sample_ms") or 0.0
        say(f"| {r['batch']} | {context} | {graph_ms:.3f} | {kernels_ms:.3f} | {graph_ms - kernels_ms:.3f} | "
            f"{count:.0f} | {r['total_ms']:.3f} | "
            + ", ".join(f"{k} {v['us'] / 1e3:.3f} ({v['kernels']:.0f})" for k, v in
                        sorted(groups.items(), key=lambda kv: -kv[1]["us"])) + " |")


MIXED_GROUPS = (  # (group, substrings of the CUDA kernel name), first match wins
    ("decode attention", ("_decode_partition_kernel", "_decode_reduce_kernel")),
    ("prefill attention", ("_prefill_kernel",)),
    ("kv store", ("_store_kv_kernel",)),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "cublas", "splitK")),
    ("RMSNorm", ("_rms_norm_kernel",)),
    ("SiLU-and-mul", ("_silu_and_mul_kernel",)),
    ("q/k norm + rotary + kv store", ("_qk_norm_rotary_kernel",)),  # the triton backend stores in it
    ("sampler", ("_sample", "_row_keys", "argmax", "softmax", "topk", "sort")),
)


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens with every sampling extra neutral."""
    from llmcli import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, top_p=1.0, top_k=-1, min_p=0.0,
                          repetition_penalty=1.0)


def kernel_groups(prof: Any) -> tuple[dict[str, list[float]], list[tuple[float, int, str]]]:
    """A profile's CUDA kernels by ``MIXED_GROUPS`` group: {group: [kernels, ms]}, and (ms, count, name) of each."""
    from torch.autograd import DeviceType

    groups: dict[str, list[float]] = {}
    top = []
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        group = next((g for g, keys in MIXED_GROUPS if any(k in evt.key for k in keys)), "other")
        row = groups.setdefault(group, [0, 0.0])
        row[0] += evt.count
        row[1] += evt.self_device_time_total / 1e3
        top.append((evt.self_device_time_total / 1e3, evt.count, evt.key[:70]))
    return groups, top


def allocator_events(device: str) -> dict[str, int]:
    """Counters of the CUDA caching allocator (a cudaMalloc/cudaFree inside a step can stall the host)."""
    if device != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    return {k: int(stats.get(k, 0)) for k in keys}


def mixed_breakdown(llm: Any, facts: dict[str, Any], decode_rows: int, new_prompts: int, prompt_len: int,
                    device: str) -> None:
    """One mixed step like the prefill-heavy preset's: ``decode_rows`` sequences decoding (context ~prompt_len)
    and ``new_prompts`` fresh prompts prefilled beside them; device time by kernel group (profiler) and the
    step's wall time with a sync."""
    import random

    engine = llm.engine
    engine.scheduler.mixed_steps = True  # whatever the engine's default: this probe is about mixed steps
    rng = random.Random(5)
    vocab = facts["vocab"]
    params = greedy(64)
    engine.scheduler.block_manager.reset_prefix_cache()
    for i in range(decode_rows):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params, request_id=f"mix-d{i}")
    sched = engine.scheduler
    while sched.waiting or not all(s.num_completion_tokens >= 1 for s in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    for i in range(new_prompts):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params, request_id=f"mix-p{i}")
    sync()
    tokens0 = dict(engine.step_timer.tokens)
    t = time.perf_counter()
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        wall = time.perf_counter() - t
        groups, top = kernel_groups(prof)
        total = sum(r[1] for r in groups.values())
        kind = engine.step_timer.kind
        say(f"\nmixed step: {decode_rows} decode rows (context ~{prompt_len}) + {new_prompts} x {prompt_len}-token "
            f"prompts asked, kind {kind}, {engine.step_timer.tokens[kind] - tokens0.get(kind, 0)} tokens in the step; "
            f"wall with profiler {1e3 * wall:.2f} ms, kernels {total:.2f} ms")
        say("| group | kernels | ms | share |")
        say("|---|---:|---:|---:|")
        for name, (count, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            say(f"| {name} | {count} | {ms:.3f} | {100 * ms / total:.1f}% |")
        say("top kernels: " + "; ".join(f"{ms:.3f} ms x{n} {name}" for ms, n, name in sorted(top, reverse=True)[:8]))
    else:
        engine.step()
        kind = engine.step_timer.kind
        say(f"\nmixed step (CPU): {1e3 * (time.perf_counter() - t):.1f} ms, kind {kind}, "
            f"{engine.step_timer.tokens[kind] - tokens0.get(kind, 0)} tokens")
    # the same kind of step again without the profiler: wall time, step-timer phases, allocator events
    for i in range(new_prompts):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params, request_id=f"mix-q{i}")
    sync()
    timer = engine.step_timer
    before, tokens0 = dict(timer.seconds), dict(timer.tokens)
    mem0 = allocator_events(device)
    t = time.perf_counter()
    engine.step()
    launched = time.perf_counter() - t
    sync()
    kind = timer.kind
    phases = {p: 1e3 * (timer.seconds[(kind, p)] - before.get((kind, p), 0.0)) for (k, p) in list(timer.seconds)
              if k == kind}
    mem1 = allocator_events(device)
    say(f"the next such step without the profiler: {1e3 * (time.perf_counter() - t):.2f} ms with a sync, "
        f"engine.step() returned after {1e3 * launched:.2f} ms (kind {kind}, "
        f"{timer.tokens[kind] - tokens0.get(kind, 0)} tokens); its step-timer phases (ms): "
        + ", ".join(f"{p} {v:.2f}" for p, v in phases.items() if v > 0.005))
    say("  caching allocator during that step: " + ", ".join(f"{k} +{mem1[k] - mem0[k]}" for k in mem0)
        + (f"; reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if device == "cuda" else ""))
    # and once more under cProfile: where the host's time goes (cProfile slows Python ~1.5-2x)
    import cProfile
    import io
    import pstats

    for i in range(new_prompts):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params, request_id=f"mix-c{i}")
    sync()
    prof = cProfile.Profile()
    prof.enable()
    engine.step()
    sync()
    prof.disable()
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(22)
        say(f"cProfile of that kind of step ({timer.kind}), by {order}:")
        say("\n".join(line[:150] for line in buf.getvalue().splitlines()[6:] if line.strip()))
    while engine.has_unfinished():
        engine.step()


def kernel_union_ms(trace_path: str) -> tuple[float, float, int]:
    """(device busy ms, span ms from the first kernel's start to the last one's end, kernels) of a chrome trace."""
    import json

    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3, (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0, len(spans)


def busy_window(llm: Any, facts: dict[str, Any], spec: str, device: str) -> None:
    """The prefill-heavy preset's steady state: ``NxLxSxW`` = N prompts of ~L tokens (32 output tokens each),
    S steps to fill the engine, then W steps under the profiler: how busy the device was over those steps
    (union of kernel intervals / their span), and the host's wall ms per step kind with its phases. Busy near
    100% means the device sets the pace (kernel speed is the lever); well under, the host does."""
    import random
    import tempfile

    n, length, skip, window = (int(x) for x in spec.split("x"))
    engine = llm.engine
    rng = random.Random(11)
    vocab = facts["vocab"]
    params = greedy(32)
    engine.scheduler.block_manager.reset_prefix_cache()
    for i in range(n):
        engine.add_request([rng.randrange(vocab) for _ in range(length + rng.randrange(-30, 31))], params,
                           request_id=f"busy-{i}")
    for _ in range(skip):
        engine.step()
    timer = engine.step_timer
    before_s, before_n, before_t = dict(timer.seconds), dict(timer.steps), dict(timer.tokens)
    kinds: dict[str, list[float]] = defaultdict(list)
    trace = tempfile.mktemp(suffix=".json")
    t0 = time.perf_counter()
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(window):
                t = time.perf_counter()
                engine.step()
                kinds[timer.kind].append(1e3 * (time.perf_counter() - t))
            sync()
        wall = 1e3 * (time.perf_counter() - t0)
        prof.export_chrome_trace(trace)
        busy, span, count = kernel_union_ms(trace)
        os.unlink(trace)
    else:
        for _ in range(window):
            t = time.perf_counter()
            engine.step()
            kinds[timer.kind].append(1e3 * (time.perf_counter() - t))
        wall, busy, span, count = 1e3 * (time.perf_counter() - t0), 0.0, 0.0, 0
    say(f"\nsteady state of {n} x ~{length}-token prompts (32 out), {window} steps after {skip}: wall {wall:.1f} ms,"
        f" device busy {busy:.1f} ms of a {span:.1f} ms kernel span ({100 * busy / max(span, 1e-9):.0f}%), "
        f"{count} kernels/copies")
    for kind, times in kinds.items():
        steps = timer.steps[kind] - before_n.get(kind, 0)
        tokens = timer.tokens[kind] - before_t.get(kind, 0)
        phases = {p: 1e3 * (timer.seconds[(k, p)] - before_s.get((k, p), 0.0)) / max(steps, 1)
                  for (k, p) in list(timer.seconds) if k == kind}
        say(f"  {kind}: {len(times)} steps, {tokens / max(steps, 1):.0f} tokens/step, engine.step() median "
            f"{statistics.median(times):.2f} ms; phases ms/step: "
            + ", ".join(f"{p} {v:.2f}" for p, v in phases.items() if v > 0.005))
    while engine.has_unfinished():
        engine.step()


def preset_profile(llm: Any, facts: dict[str, Any], n: int, device: str) -> None:
    """``n`` prompts shaped like the prefill-heavy preset's (540-600 tokens, 32 out, greedy) through
    ``LLM.generate`` under the profiler, with mixed steps off then on: the run's wall time against the sum of its
    kernels by group (one stream, so the sum is the time the device was busy), and per group the share of the
    run. The whole job, not a window: start, steady state and tail."""
    import random

    rng = random.Random(13)
    vocab = facts["vocab"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(540, 600))] for _ in range(n)]
    params = greedy(32)
    for mixed in (False, True):
        llm.engine.scheduler.mixed_steps = mixed
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        sync()
        t = time.perf_counter()
        if device != "cuda":
            llm.generate(prompts, params)
            say(f"\npreset-shaped job, {n} prompts, mixed_steps={mixed} (CPU): {time.perf_counter() - t:.1f} s")
            continue
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params)
            sync()
        wall = 1e3 * (time.perf_counter() - t)
        groups, _ = kernel_groups(prof)
        total = sum(r[1] for r in groups.values())
        say(f"\npreset-shaped job, {n} prompts, mixed_steps={mixed}, max_num_seqs {llm.engine.config.max_num_seqs}: "
            f"wall {wall / 1e3:.2f} s under the profiler, kernels {total / 1e3:.2f} s ({100 * total / wall:.0f}% busy)")
        say("| group | kernels | s | share of kernels |")
        say("|---|---:|---:|---:|")
        for name, (count, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            say(f"| {name} | {count} | {ms / 1e3:.3f} | {100 * ms / total:.1f}% |")


def default_profile(llm: Any, prompts: list[list[int]], outs: list[int], device: str) -> None:
    """The default bench workload (greedy, every request to its full length) under the profiler, then the same
    prompts with one output token each: the whole run's kernels by group, the prefill-only run's, and their
    difference (the decode steps and the tail), against the run's wall time (one stream: the kernel sum is the
    time the device was busy). Where a model's time over its physical bound goes, by kernel group."""
    from torch.profiler import ProfilerActivity, profile

    tables = []
    for name, lengths in (("whole run", outs), ("prefill only (1 output token)", [1] * len(outs))):
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        sync()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, [greedy(n) for n in lengths])
            sync()
        wall = time.perf_counter() - t
        groups, _ = kernel_groups(prof)
        tables.append((name, wall, {g: (int(c), ms / 1e3) for g, (c, ms) in groups.items()}))
    (_, wall, whole), (_, pre_wall, pre) = tables
    say(f"\ndefault workload, {len(prompts)} requests, {sum(outs):,} output tokens, under the profiler: wall "
        f"{wall:.2f} s (prefill-only run {pre_wall:.2f} s)")
    say("| group | whole run: kernels | s | prefill only: kernels | s | difference s |")
    say("|---|---:|---:|---:|---:|---:|")
    names = sorted(set(whole) | set(pre), key=lambda g: -whole.get(g, (0, 0.0))[1])
    for g in names + ["all kernels"]:
        (c, sec), (pc, psec) = ((sum(v[0] for v in d.values()), sum(v[1] for v in d.values())) if g == "all kernels"
                                else d.get(g, (0, 0.0)) for d in (whole, pre))
        say(f"| {g} | {c} | {sec:.3f} | {pc} | {psec:.3f} | {sec - psec:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/Qwen3-0.6B")
    p.add_argument("--settings", nargs="*", default=["base", "threads1", "nogc", "base"])
    p.add_argument("--batches", nargs="*", type=int, default=[256, 64, 16])
    p.add_argument("--context", type=int, default=800)
    p.add_argument("--device", default="cuda")
    p.add_argument("--mixed", default="464x16x570",
                   help="DxNxL: a mixed step of D decoding sequences and N new L-token prompts (none: skip)")
    p.add_argument("--busy", default="",
                   help="NxLxSxW: N prompts of ~L tokens, W profiled steps after S (e.g. 3000x570x150x40)")
    p.add_argument("--preset", type=int, default=0,
                   help="N: a job of N prompts shaped like the prefill-heavy preset under the profiler (0 skips)")
    p.add_argument("--default-profile", action="store_true",
                   help="the default workload under the profiler, kernels by group, and its prefill alone")
    p.add_argument("--engine", nargs="*", default=[], help="engine settings as name=value (max_num_seqs=1024)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a few small requests, no breakdown")
    args = p.parse_args(argv)
    from llmcli import LLM

    model = Path(args.model) if Path(args.model).is_absolute() else REPO / args.model
    facts = model_facts(model)
    workload = Workload(num_prompts=8, input_len=(10, 40), output_len=(4, 12)) if args.tiny else Workload()
    reqs = make_requests(workload, facts["vocab"], set(facts["eos_token_ids"]))
    prompts, outs = [r[0] for r in reqs], [r[1] for r in reqs]
    t = time.perf_counter()
    from benchmarks.speed_gpu import variant_kwargs

    llm = LLM(str(model), load_format="dummy", seed=0, device=args.device, 
              **(variant_kwargs("+".join(args.engine)) if args.engine else {}))
    engine = llm.engine
    say(f"{facts['name']}: ready in {time.perf_counter() - t:.1f} s; torch threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}, switch interval {sys.getswitchinterval()}")
    phases = CpuPhases()
    phases.install(engine)
    run_once(llm, engine, phases, prompts, outs, "warm-up")
    for setting in args.settings:
        run_once(llm, engine, phases, prompts, outs, setting)
    del engine.step_timer.phase
    if args.batches:
        breakdown(llm, facts, args.batches, args.context, args.device)
    if args.mixed and args.mixed != "none":
        d, n, length = (int(x) for x in args.mixed.split("x"))
        mixed_breakdown(llm, facts, d, n, length, args.device)
    for mixed in (False, True) if args.busy else ():
        engine.scheduler.mixed_steps = mixed
        say(f"(busy window with mixed_steps={mixed})")
        busy_window(llm, facts, args.busy, args.device)
    if args.preset:
        preset_profile(llm, facts, args.preset, args.device)
    if args.default_profile:
        default_profile(llm, prompts, outs, args.device)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
