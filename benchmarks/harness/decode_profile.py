"""llmcli's decode step at a large batch: wall time, device time, host share, step timer and kernel groups."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

from benchmarks.harness.ceilings import sync, time_op
from benchmarks.harness.llmcli_run import timer_delta, timer_summary
from benchmarks.harness.output import fmt_f, log, say
from benchmarks.harness.report import Report, fail
from benchmarks.harness.workload import NEUTRAL

KERNEL_GROUPS = (  # (group, substrings of the CUDA kernel name), first match wins
    ("attention, KV store", ("_decode_partition_kernel", "_decode_reduce_kernel", "_prefill_kernel", "flash", "_kv_")),
    ("linear attention (conv, delta rule)", ("_delta_step_kernel", "_conv_step_kernel", "_conv_varlen", "chunk_")),
    ("MoE experts (fused Triton)", ("_moe_gate_up", "_moe_down", "_mxfp4_", "_frag_", "_align_kernel")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "cublas", "splitK")),
    ("elementwise (Triton kernels)", ("rms_norm_kernel", "_silu_and_mul_kernel", "_qk_norm_rotary_kernel")),
    ("fused elementwise (torch.compile)", ("triton_",)),
    ("copies and fills", ("Memcpy", "Memset")),
)


def kernel_group(name: str) -> str:
    """The group of ``KERNEL_GROUPS`` a device record's name falls in ("other" if none)."""
    return next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")


def kernel_groups(op: Callable[[], Any], reps: int) -> dict[str, dict[str, float]]:
    """Device time per step of each kernel group, from the profiler's kernel records (eager launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            op()
        torch.cuda.synchronize()
    groups: dict[str, dict[str, float]] = {}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        group = kernel_group(evt.key)
        row = groups.setdefault(group, {"kernels": 0.0, "us": 0.0})
        row["kernels"] += evt.count / reps
        row["us"] += evt.self_device_time_total / reps
    return groups


def probe_device_time(runner: Any, plan: Any, reps: int, device: str) -> dict[str, float]:
    """Device time of one decode step's forward (+ sample), launched back to back; and its host prepare time."""
    from llmcli.engine.step_inputs import prepare_decode

    uploader = runner.uploader
    out: dict[str, float] = {}
    with torch.inference_mode():
        prep = []
        for _ in range(5):
            t = time.perf_counter()
            runner.rows.update(plan, uploader)  # the row table as the launch leaves it (writing twice changes nothing)
            inputs = prepare_decode(plan, uploader, runner.rows.group_tables)
            sampling = runner.rows.sampling(*runner.rows.sampled(plan), uploader)
            sync(device)
            prep.append(time.perf_counter() - t)
        out["prepare_ms"] = 1e3 * statistics.median(prep)

        def forward() -> Any:
            return runner._forward(inputs)

        def forward_sample() -> Any:
            logits = runner._forward(inputs)
            if sampling is None:
                return logits.argmax(dim=-1)
            return runner.sampler(logits, sampling)

        if device == "cuda":
            # kernel by kernel: the same step launched eagerly (graph replays hide the kernels from the profiler)
            graphs, runner.graphs = runner.graphs, None
            try:
                forward_sample()
                out["kernel_groups"] = kernel_groups(forward_sample, 5)
            except Exception as exc:  # the profile is a bonus: keep the timings below
                log(f"kernel profile failed: {type(exc).__name__}: {exc}")
            finally:
                runner.graphs = graphs
        for label, op in (("forward_ms", forward), ("forward_sample_ms", forward_sample)):
            out[label] = 1e3 * statistics.mean(time_op(op, device, reps, warmup=3))  # back to back, events between
    return out


def decode_breakdown(args: argparse.Namespace, report: Report, llm: Any, facts: dict[str, Any],
                     mean_prompt: int) -> None:
    from llmcli import SamplingParams

    engine = llm.engine
    sched = engine.scheduler
    name = facts["name"]
    if engine.has_unfinished():
        raise RuntimeError("the engine still has requests; the probe needs it idle")
    batch = args.breakdown_batch
    max_seqs = engine.config.max_num_seqs
    if batch > max_seqs:
        log(f"breakdown batch {batch} > max_num_seqs {max_seqs}; using {max_seqs}")
        batch = max_seqs
    ctx, steps, warm = mean_prompt, args.breakdown_steps, min(5, args.breakdown_steps)
    rng = random.Random(args.seed + 2)
    params = SamplingParams(temperature=args.temperature, max_tokens=warm + steps + 3, **NEUTRAL)
    for i in range(batch):
        engine.add_request([rng.randrange(facts["vocab"]) for _ in range(ctx)], params, request_id=f"probe-{i}")
    preempt0 = engine.stats.num_preemptions
    t = time.perf_counter()
    for _ in range(100000):  # prefill every probe sequence
        if not sched.waiting and all(s.num_completion_tokens >= 1 for s in sched.running):
            break
        engine.step()
    prefill_s = time.perf_counter() - t
    running = len(sched.running)
    result: dict[str, Any] = {"batch_requested": batch, "batch": running, "context": ctx, "prefill_s": prefill_s}
    report.data["decode_breakdown"][name] = result
    if running != batch:
        log(f"only {running} of {batch} probe sequences run together (KV pool or max_num_seqs)")
    for _ in range(warm):
        engine.step()

    # one step with the device-time probe inside model_runner.run (not among the timed steps)
    runner = engine.model_runner
    probe: dict[str, Any] = {}
    original = runner.launch

    def launch_with_probe(plan: Any, *rest: Any) -> Any:
        if not plan.is_prefill and "done" not in probe:
            probe["done"] = True
            try:
                probe.update(probe_device_time(runner, plan, 20 if args.device == "cuda" else 3, args.device))
            except Exception as exc:
                probe["error"] = f"{type(exc).__name__}: {exc}"
                print(traceback.format_exc(), file=sys.stderr, flush=True)
        return original(plan, *rest)

    runner.launch = launch_with_probe
    try:
        engine.step()
    finally:
        del runner.launch  # back to the class method
    if "error" in probe:
        fail(report, f"llmcli {name} device-time probe", probe["error"])

    before = timer_summary(engine)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()  # steady state: launches this step, reads back the previous one
        walls.append(time.perf_counter() - t)
    timers = timer_delta(before, timer_summary(engine))
    while engine.has_unfinished():
        engine.step()
    total_ms = 1e3 * statistics.median(walls)
    gpu_ms = probe.get("forward_sample_ms")
    result.update(
        steps_timed=len(walls), total_ms=total_ms, total_ms_mean=1e3 * sum(walls) / len(walls),
        gpu_forward_ms=probe.get("forward_ms"), gpu_forward_sample_ms=gpu_ms, kernel_groups=probe.get("kernel_groups"),
        host_ms=(total_ms - gpu_ms) if gpu_ms is not None else None, prepare_probe_ms=probe.get("prepare_ms"),
        step_timer=(timers or {}).get("decode"), preemptions=engine.stats.num_preemptions - preempt0,
        batch_tokens_per_s=running / (total_ms / 1e3))
    if result["preemptions"]:
        log(f"{result['preemptions']} preemptions during the probe: the timed steps may not all be at batch {running}")
    st = result["step_timer"] or {}
    say(f"llmcli {name} decode step at batch {running}, context ~{ctx}: total {fmt_f(total_ms)} ms/step, "
        f"device (forward+sample) {fmt_f(gpu_ms)} ms, host (total - device) {fmt_f(result['host_ms'])} ms; "
        f"step timer: host {fmt_f(st.get('host_ms'))} ms, forward {fmt_f(st.get('forward_ms'))} ms")
