#!/usr/bin/env python3
"""Where the device idles during the default workload's decode: the engine's own steps, profiled in windows.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness.bound import Shape, active_params  # noqa: E402
from benchmarks.harness.ceilings import DTYPES, free_memory, measure_ceilings, sync  # noqa: E402
from benchmarks.harness.device_idle import idle_report, load_trace, trace_spans  # noqa: E402
from benchmarks.harness.output import fmt_f, log, md_table, out_path, say, write_json  # noqa: E402
from benchmarks.harness.script_args import add_device_args, settle_device  # noqa: E402
from benchmarks.harness.workload import (  # noqa: E402
    NEUTRAL, add_workload_args, make_workload, model_facts, resolve_model, write_tiny_config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["configs/Qwen2.5-7B", "configs/Qwen3-8B"])
    ap.add_argument("--at", nargs="+", type=int, default=[60, 400, 800],
                    help="decode steps (from the first) where a window starts")
    ap.add_argument("--steps", type=int, default=20, help="steps per window (timed, then profiled)")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES))
    add_device_args(ap, smoke="CPU, a tiny random Qwen3, small windows")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    settle_device(ap, args)
    if args.smoke:
        args.num_prompts, args.min_input, args.max_input, args.min_output, args.max_output = 8, 8, 32, 24, 40
        args.at, args.steps = [2, 10], 4
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def step_floors_ms(facts: dict[str, Any], contexts: list[int], elem_bytes: int,
                   ceilings: dict[str, Any]) -> tuple[float, float]:
    """The least time one decode step of these contexts takes (memory, compute): every weight (the bound's
    ``weight_bytes``) and every cached key and value read once at the copy bandwidth; the linear layers' and the
    attention's FLOPs at the matmul rate (``benchmarks/harness/bound.py``'s terms, for one step)."""
    shape = Shape(facts, contexts, [1] * len(contexts), elem_bytes)
    memory = (shape.weight_bytes + sum(contexts) * shape.kv_bytes_per_token) / ceilings["copy_bytes_per_s"]
    flops = 2 * active_params(facts) * len(contexts) \
        + 4 * facts["layers"] * facts["heads"] * facts["head_dim"] * sum(contexts)
    return 1e3 * memory, 1e3 * flops / ceilings["matmul_flops_per_s"]


def run_model(args: argparse.Namespace, model_dir: Path, trace_dir: Path, ceilings: dict[str, Any]) -> dict[str, Any]:
    from llmcli import LLM, SamplingParams

    facts = model_facts(model_dir)
    prompts, outs, _ = make_workload(args, facts)
    extra = {"num_kvcache_blocks": 128, "kvcache_block_size": 16} if args.smoke else {}
    llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=args.device, seed=args.seed, **extra)
    result: dict[str, Any] = {"model": facts["name"], "windows": []}
    try:
        engine = llm.engine
        llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=4, **NEUTRAL))  # warm-up
        for p, o in zip(prompts, outs):
            engine.add_request(p, SamplingParams(temperature=args.temperature, max_tokens=o, **NEUTRAL))
        starts = sorted(set(args.at))
        decode_steps, t0 = 0, time.perf_counter()

        def step() -> str | None:
            nonlocal decode_steps
            engine.step()
            kind = engine.step_timer.kind
            if kind == "decode":
                decode_steps += 1
            return kind

        while engine.has_unfinished():
            if starts and decode_steps >= starts[0]:
                starts.pop(0)
                window = profile_window(args, engine, step, decode_steps, trace_dir, facts["name"])
                window["floor_ms_memory"], window["floor_ms_compute"] = step_floors_ms(
                    facts, window.pop("contexts"), DTYPES[args.dtype].itemsize, ceilings)
                result["windows"].append(window)
                continue
            step()
        sync(args.device)
        result["run_s_with_windows"] = time.perf_counter() - t0
        result["decode_steps"] = decode_steps
    finally:
        with contextlib.suppress(Exception):
            llm.shutdown()
        del llm
        free_memory(args.device)
    return result


def profile_window(args: argparse.Namespace, engine: Any, step: Any, at: int, trace_dir: Path,
                   name: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    n = args.steps
    running = engine.scheduler.running
    batch, contexts = len(running), [len(seq) for seq in running]
    sync(args.device)
    t = time.perf_counter()
    kinds = [step() for _ in range(n)]
    sync(args.device)
    plain_ms = 1e3 * (time.perf_counter() - t) / n
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        kinds += [step() for _ in range(n)]
        sync(args.device)
        profiled_ms = 1e3 * (time.perf_counter() - t) / n
    path = trace_dir / f"{name}-{at}.json"
    prof.export_chrome_trace(str(path))
    device, waits = trace_spans(load_trace(path))
    with contextlib.suppress(OSError):
        path.unlink()
    window = {"at_decode_step": at, "batch": batch, "contexts": contexts, "mean_context": sum(contexts) / max(batch, 1),
              "steps": n, "kinds": sorted(set(k or "none" for k in kinds)),
              "wall_ms_per_step": plain_ms, "wall_ms_per_step_profiled": profiled_ms,
              **idle_report(device, n, waits)}
    log(f"{name} @ decode step {at} (batch {batch}): {plain_ms:.2f} ms/step, profiled {profiled_ms:.2f}; "
        f"device idle {fmt_f(window.get('idle_us_per_step'), 0)} us/step")
    return window


def print_tables(results: list[dict[str, Any]]) -> None:
    rows, group_rows = [], []
    for r in results:
        for w in r["windows"]:
            head = [r["model"], w["at_decode_step"], w["batch"], f"{w['mean_context']:.0f}",
                    fmt_f(w["wall_ms_per_step"]), fmt_f(w["wall_ms_per_step_profiled"]),
                    f"{fmt_f(w['floor_ms_memory'])} / {fmt_f(w['floor_ms_compute'])}"]
            if not w.get("device_records"):
                rows.append(head + ["no device records"] + [""] * 5)
                continue
            rows.append(head + [fmt_f(w["busy_us_per_step"] / 1e3),
                                f"{w['idle_us_per_step']:.0f} ({100 * w['idle_share']:.1f}%)",
                                f"{w['records_per_step']:.0f}",
                                " / ".join(f"{x['idle_us_per_step']:.0f}" for x in w["gap_buckets"]),
                                fmt_f(w["host_wait_us_per_step"] / 1e3)])
            group_rows.append([r["model"], w["at_decode_step"], w["batch"]] + [
                "; ".join(f"{g} {v['us'] / 1e3:.2f} ms ({v['records']:.0f})" for g, v in w["groups"].items())])
    say(md_table(["model", "decode step", "batch", "mean context", "wall ms/step", "profiled", "floor ms (memory / compute)",
                  "device busy ms", "idle us (share)", "records", "idle us in gaps <1 / 1-3 / 3-10 / 10-50 / >50 us",
                  "host waits ms"], rows))
    if group_rows:
        say("\ndevice time per step by kernel group (records per step)")
        say(md_table(["model", "decode step", "batch", "groups"], group_rows, right={1, 2}))
    for r in results:
        for w in r["windows"]:
            if w.get("worst_pairs"):
                say(f"\n{r['model']} @ {w['at_decode_step']} (batch {w['batch']}): idle by the kernels around it")
                say(md_table(["before", "after", "gaps/step", "idle us/step", "mean gap us"],
                             [[p["before"], p["after"], fmt_f(p["gaps_per_step"], 1), fmt_f(p["idle_us_per_step"], 1),
                               fmt_f(p["mean_gap_us"], 1)] for p in w["worst_pairs"]]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = [write_tiny_config()] if args.smoke else [resolve_model(m) for m in args.models]
    json_path = out_path("step_gaps.json")
    results, failures = [], 0
    ceilings = measure_ceilings(args.device, tiny=args.smoke)
    with tempfile.TemporaryDirectory(prefix="llmcli-gaps-") as tmp:
        for m in models:
            try:
                results.append(run_model(args, m, Path(tmp), ceilings))
            except Exception as exc:  # the other models still run
                failures += 1
                say(f"FAILED: {m.name}: {type(exc).__name__}: {exc}")
            write_json(json_path, results)
    print_tables(results)
    say(f"\n{failures} failed model(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
