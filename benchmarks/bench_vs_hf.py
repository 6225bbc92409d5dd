#!/usr/bin/env python
"""llmcli against HuggingFace transformers' own continuous batching, in one process, on one GPU.

What it does, in order (every section is guarded: a failure prints a FAILED line and the rest runs on):

1. Ceilings of the machine: device-to-device copy bandwidth and bf16 matmul rate (medians).
2. The workload of ``llmcli bench`` (random token ids, seed 0, lengths uniform in [100, 1024], EOS ignored).
3. llmcli on each model (dummy weights from ``config.json``): warm-up, then one timed ``LLM.generate``;
   every request must produce exactly its output length.
4. llmcli's decode step at batch 256: wall time of a whole engine step, device time of forward + sample,
   and the host share, plus the engine's own per-phase step timer.
5. transformers' continuous batching (``init_continuous_batching`` + per-request ``add_request``) on the
   same workload, random weights, EOS disabled.
6. The physical bound of the workload: bytes decode must read over the copy bandwidth plus prefill FLOPs
   over the matmul rate, and each engine's share of it.
7. One Markdown table (pasteable into benchmarks/RESULTS.md), and every number as JSON in ``$OUT/bench.json``
   (rewritten after every section, so a run cut short still leaves what it measured).

    python benchmarks/bench_vs_hf.py                          # the real benchmark (GPU): both models
    python benchmarks/bench_vs_hf.py --models configs/Qwen3-0.6B                # split in two: 0.6B + transformers
    python benchmarks/bench_vs_hf.py --models configs/Qwen3-8B --skip-hf        #   then 8B, llmcli only
    python benchmarks/bench_vs_hf.py --device cpu --tiny      # seconds on a CPU: a tiny random Qwen3

Exit status 0 when every section passed, 1 when any printed FAILED. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_MODELS = ["configs/Qwen3-0.6B", "configs/Qwen3-8B"]
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "attention_bias": False, "hidden_act": "silu", "use_cache": True,
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
START = time.perf_counter()


# -- output -------------------------------------------------------------------------------------------

def say(msg: str = "") -> None:
    """Results: stdout."""
    print(msg, flush=True)


def log(msg: str) -> None:
    """Progress: stderr, time-stamped from the start of the script."""
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fmt_int(x: Any) -> str:
    return f"{int(x):,}" if isinstance(x, (int, float)) else "n/a"


def fmt_f(x: Any, digits: int = 2) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else "n/a"


def md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def md_table(header: list[str], rows: list[list[Any]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(header)))
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    """Every number the run produces; written as JSON after every section."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": {}, "ceilings": {}, "workloads": {}, "llmcli": {}, "transformers": {},
                                     "bounds": {}, "decode_breakdown": {}, "sections": {}, "failures": []}

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            tmp.replace(self.path)
        except OSError as exc:
            log(f"could not write {self.path}: {exc}")


def section(report: Report, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one section; on failure print FAILED, record it, and carry on."""
    log(f"== {name}")
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # every section must let the others run
        tb = traceback.format_exc()
        last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        say(f"FAILED: {name}: {last}")
        print(tb, file=sys.stderr, flush=True)
        report.data["failures"].append({"section": name, "error": last, "traceback": tb})
        return None
    finally:
        report.data["sections"][name] = round(time.perf_counter() - start, 3)
        report.save()


def fail(report: Report, name: str, why: str) -> None:
    say(f"FAILED: {name}: {why}")
    report.data["failures"].append({"section": name, "error": why})
    report.save()


# -- device helpers ---------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        log(f"cuda memory after cleanup: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")


def time_op(op: Callable[[], Any], device: str, reps: int, warmup: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``op`` (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        op()
    sync(device)
    times = []
    if device == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in pairs:
            a.record()
            op()
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in pairs]
    else:
        for _ in range(reps):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
    return times


# -- 1. ceilings -------------------------------------------------------------------------------------

def measure_ceilings(args: argparse.Namespace, report: Report) -> None:
    dev, dtype = args.device, DTYPES[args.ceiling_dtype]
    out = report.data["ceilings"]
    out.update(device=dev, dtype=args.ceiling_dtype)
    if args.copy_bw is not None:
        out.update(copy_bytes_per_s=args.copy_bw * 1e12, copy_source="--copy-bw")
    else:
        numel = int(args.copy_gib * 2**30) // dtype.itemsize
        src = torch.randn(numel, device=dev).to(dtype) if dev == "cpu" else torch.randn(numel, dtype=dtype, device=dev)
        dst = torch.empty_like(src)
        times = time_op(lambda: dst.copy_(src), dev, args.ceiling_reps, warmup=3)
        moved = 2 * numel * dtype.itemsize  # read once, written once
        med = statistics.median(times)
        out.update(copy_bytes_per_s=moved / med, copy_tensor_bytes=numel * dtype.itemsize, copy_median_s=med,
                   copy_reps=len(times), copy_source="measured")
        del src, dst
        free_memory(dev)
    say(f"copy bandwidth: {out['copy_bytes_per_s'] / 1e12:.3f} TB/s ({out['copy_source']}; bytes read + written)")
    if args.matmul_tflops is not None:
        out.update(matmul_flops_per_s=args.matmul_tflops * 1e12, matmul_source="--matmul-tflops")
    else:
        n = args.matmul_n
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        c = torch.empty(n, n, dtype=dtype, device=dev)
        times = time_op(lambda: torch.matmul(a, b, out=c), dev, args.ceiling_reps, warmup=5)
        med = statistics.median(times)
        out.update(matmul_flops_per_s=2 * n ** 3 / med, matmul_n=n, matmul_median_s=med, matmul_reps=len(times),
                   matmul_source="measured")
        del a, b, c
        free_memory(dev)
    how = out["matmul_source"] + (f", {args.ceiling_dtype} {out['matmul_n']}^3" if "matmul_n" in out else "")
    say(f"matmul rate: {out['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({how})")


# -- 2. workload -------------------------------------------------------------------------------------

def model_facts(model_dir: Path) -> dict[str, Any]:
    """Shapes from config.json, analytic parameter count (Qwen3 layout), EOS ids."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    eos: list[int] = []
    try:
        from llmcli.models.hub import load_generation_eos

        eos = load_generation_eos(model_dir, cfg)
    except Exception as exc:  # the workload only uses this to mirror llmcli bench
        log(f"EOS ids not read ({exc}); none avoided")
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    inter = cfg.intermediate_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    bias = bool(getattr(cfg, "attention_bias", False))
    per_layer = (H * nh * hd + 2 * H * nkv * hd + nh * hd * H  # q, k, v, o
                 + 3 * H * inter  # gate, up, down
                 + 2 * H + 2 * hd  # input/post-attention norms, q/k norms
                 + ((nh + 2 * nkv) * hd if bias else 0))
    embed = V * H
    head = 0 if tied else V * H
    total = embed + head + L * per_layer + H
    return {"name": model_dir.name, "path": str(model_dir), "hidden": H, "layers": L, "heads": nh, "kv_heads": nkv,
            "head_dim": hd, "intermediate": inter, "vocab": V, "tied_embeddings": tied, "params": total,
            "params_non_embedding": total - embed - head, "eos_token_ids": eos}


def make_workload(args: argparse.Namespace, facts: dict[str, Any]) -> tuple[list[list[int]], list[int], str]:
    """The requests of ``llmcli bench`` (its own generator when importable, else the same algorithm)."""
    try:
        from llmcli.cli.bench import Workload, make_requests

        w = Workload(num_prompts=args.num_prompts, input_len=(args.min_input, args.max_input),
                     output_len=(args.min_output, args.max_output), temperature=args.temperature, seed=args.seed)
        reqs = make_requests(w, facts["vocab"], set(facts["eos_token_ids"]))
        source = "llmcli.cli.bench.make_requests"
    except ImportError:
        rng = random.Random(args.seed)
        avoid = set(facts["eos_token_ids"])
        allowed = [t for t in range(facts["vocab"]) if t not in avoid]
        reqs = []
        for _ in range(args.num_prompts):
            n_in = rng.randint(args.min_input, args.max_input)
            n_out = rng.randint(args.min_output, args.max_output)
            reqs.append(([allowed[rng.randrange(len(allowed))] for _ in range(n_in)], n_out))
        source = "bench_vs_hf fallback (same algorithm as llmcli.cli.bench)"
    return [r[0] for r in reqs], [r[1] for r in reqs], source


def describe_workload(prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    ins = [len(p) for p in prompts]
    return {"requests": len(prompts), "prompt_tokens": sum(ins), "output_tokens": sum(outs),
            "prompt_len_min": min(ins), "prompt_len_max": max(ins), "prompt_len_mean": sum(ins) / len(ins),
            "output_len_min": min(outs), "output_len_max": max(outs), "output_len_mean": sum(outs) / len(outs)}


# -- 3. llmcli ---------------------------------------------------------------------------------------

def llmcli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"load_format": "dummy", "dtype": args.dtype, "device": args.device, "seed": args.seed}
    for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "attention_backend",
                 "kvcache_block_size", "num_kvcache_blocks", "max_model_len"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    if args.enforce_eager:
        kw["enforce_eager"] = True
    return kw


def timer_summary(engine: Any) -> dict[str, dict[str, float]] | None:
    timer = getattr(engine, "step_timer", None)
    if timer is None:
        return None
    if hasattr(timer, "summary"):
        return {k: dict(v) for k, v in timer.summary().items()}
    return dict(timer) if isinstance(timer, dict) else None


def timer_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """Per-step means over the steps between two summaries (summaries hold means over all steps so far)."""
    if after is None:
        return None
    out = {}
    for kind, row in after.items():
        prev = (before or {}).get(kind, {})
        steps = row.get("steps", 0) - prev.get("steps", 0)
        if steps <= 0:
            continue
        d: dict[str, float] = {"steps": steps, "tokens": row.get("tokens", 0) - prev.get("tokens", 0)}
        for key, value in row.items():
            if key.endswith("_ms"):
                d[key] = (value * row["steps"] - prev.get(key, 0.0) * prev.get("steps", 0)) / steps
        out[kind] = d
    return out


def compiled_so_far() -> dict[str, int | None]:
    """Kernels compiled so far: variants of llmcli's Triton kernels, and torch.compile graphs.

    A difference across the timed run means a step stopped to compile (Triton's cache layout is
    internal, hence None where it cannot be read).
    """
    out: dict[str, int | None] = {"triton_variants": None, "dynamo_graphs": None}
    with contextlib.suppress(Exception):
        from llmcli.kernels import triton_decode, triton_prefill, triton_store

        fns = [triton_decode._decode_partition_kernel, triton_decode._decode_reduce_kernel,
               triton_prefill._prefill_kernel, triton_store._store_kv_kernel]
        out["triton_variants"] = sum(len(c[0]) for fn in fns for c in fn.device_caches.values())
    with contextlib.suppress(Exception):
        from torch._dynamo.utils import counters

        out["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    return out


def check_lengths(got: list[int], want: list[int]) -> list[str]:
    bad = [f"#{i}: {g} != {w}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if len(got) != len(want):
        bad.insert(0, f"{len(got)} outputs for {len(want)} requests")
    return bad


def llmcli_generate(llm: Any, prompts: list[list[int]], outs: list[int], temperature: float,
                    device: str) -> tuple[float, list[int]]:
    from llmcli import SamplingParams

    # filters explicit: the model's generation_config.json (top_k 20, top_p 0.95) would change the workload
    params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                             max_tokens=o, ignore_eos=True) for o in outs]
    sync(device)
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t, [len(r.token_ids) for r in results]


def run_llmcli(args: argparse.Namespace, report: Report, facts: dict[str, Any], prompts: list[list[int]],
               outs: list[int], subset: int | None) -> None:
    from llmcli import LLM

    name = facts["name"]
    entry: dict[str, Any] = {"engine_kwargs": llmcli_kwargs(args)}
    report.data["llmcli"][name] = entry
    t = time.perf_counter()
    llm = LLM(facts["path"], **entry["engine_kwargs"])
    entry["init_s"] = time.perf_counter() - t
    try:
        engine = llm.engine
        cfg = engine.config
        entry["config"] = {k: getattr(cfg, k, None) for k in (
            "device", "dtype", "attention_backend", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size",
            "max_model_len", "enforce_eager", "enable_prefix_caching", "gpu_memory_utilization")}
        runner = engine.model_runner
        mem = getattr(runner, "memory_report", None)
        if mem is not None and hasattr(mem, "as_dict"):
            entry["memory_report"] = mem.as_dict()
        entry["kv_blocks"] = getattr(runner, "num_blocks", None)
        entry["cuda_graphs"] = getattr(runner, "graphs", None) is not None
        log(f"llmcli {name}: ready in {entry['init_s']:.1f} s, backend {entry['config']['attention_backend']}, "
            f"{entry['kv_blocks']} KV blocks, CUDA graphs {'on' if entry['cuda_graphs'] else 'off'}")

        # warm-up: other tokens than the timed prompts, so it leaves no prefix-cache hits behind
        wrng = random.Random(args.seed + 1)
        n_warm = args.warmup_requests
        if n_warm:
            warm_prompts = [[wrng.randrange(facts["vocab"]) for _ in range(16)] for _ in range(n_warm)]
            wt, _ = llmcli_generate(llm, warm_prompts, [4] * n_warm, args.temperature, args.device)
            entry["warmup_s"] = wt

        before = timer_summary(engine)
        preempt0 = getattr(engine.stats, "num_preemptions", 0)
        compiled0 = compiled_so_far()
        log(f"llmcli {name}: timing {len(prompts)} requests, {sum(outs):,} output tokens")
        wall, got = llmcli_generate(llm, prompts, outs, args.temperature, args.device)
        compiled1 = compiled_so_far()
        entry["compiled_during_timed_run"] = {
            k: None if compiled0[k] is None or compiled1[k] is None else compiled1[k] - compiled0[k]
            for k in compiled0}
        say(f"llmcli {name}: compiled during the timed run: {entry['compiled_during_timed_run']}")
        entry.update(requests=len(prompts), output_tokens=sum(got), expected_output_tokens=sum(outs), wall_s=wall,
                     output_tok_s=sum(got) / wall, prompt_tokens=sum(len(p) for p in prompts),
                     preemptions=getattr(engine.stats, "num_preemptions", 0) - preempt0,
                     step_timer=timer_delta(before, timer_summary(engine)))
        bad = check_lengths(got, outs)
        entry["lengths_ok"] = not bad
        if bad:
            fail(report, f"llmcli {name} output lengths", f"{len(bad)} requests wrong: {'; '.join(bad[:5])}")
        say(f"llmcli {name}: {sum(got):,} output tokens in {wall:.2f} s = {sum(got) / wall:,.0f} tok/s "
            f"(preemptions {entry['preemptions']})")
        report.save()

        if subset:
            log(f"llmcli {name}: timing the first {subset} requests (the transformers subset)")
            swall, sgot = llmcli_generate(llm, prompts[:subset], outs[:subset], args.temperature, args.device)
            entry["subset"] = {"requests": subset, "output_tokens": sum(sgot), "wall_s": swall,
                               "output_tok_s": sum(sgot) / swall, "lengths_ok": not check_lengths(sgot, outs[:subset])}
            say(f"llmcli {name} (first {subset}): {sum(sgot):,} tokens in {swall:.2f} s = "
                f"{sum(sgot) / swall:,.0f} tok/s")
            report.save()

        if not args.skip_breakdown:
            section(report, f"llmcli {name} decode step breakdown", decode_breakdown, args, report, llm, facts,
                    sum(len(p) for p in prompts) // len(prompts))
    finally:
        with contextlib.suppress(Exception):
            llm.shutdown()
        del llm
        free_memory(args.device)


# -- 4. decode step breakdown --------------------------------------------------------------------------

KERNEL_GROUPS = (  # (group, substrings of the CUDA kernel name), first match wins
    ("attention", ("_decode_partition_kernel", "_decode_reduce_kernel", "_prefill_kernel", "flash")),
    ("kv store", ("_store_kv_kernel",)),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "cublas", "splitK")),
    ("fused elementwise (torch.compile)", ("triton_",)),
)


def kernel_groups(op: Callable[[], Any], reps: int) -> dict[str, dict[str, float]]:
    """Device time per step of each kernel group, from the profiler's kernel records (eager launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            op()
        torch.cuda.synchronize()
    groups: dict[str, dict[str, float]] = {}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        name = evt.key
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")
        row = groups.setdefault(group, {"kernels": 0.0, "us": 0.0})
        row["kernels"] += evt.count / reps
        row["us"] += evt.self_device_time_total / reps
    return groups


def probe_device_time(runner: Any, seqs: list[Any], reps: int, device: str) -> dict[str, float]:
    """Device time of one decode step's forward (+ sample), launched back to back; and its host prepare time."""
    from llmcli.engine.step_inputs import all_greedy, prepare_decode, prepare_sampling

    uploader = runner.uploader
    out: dict[str, float] = {}
    with torch.inference_mode():
        prep = []
        for _ in range(5):
            t = time.perf_counter()
            inputs = prepare_decode(seqs, uploader)
            sampling = None if all_greedy(inputs.sampled_seqs) else prepare_sampling(inputs.sampled_seqs, uploader)
            sync(device)
            prep.append(time.perf_counter() - t)
        out["prepare_ms"] = 1e3 * statistics.median(prep)

        def forward() -> Any:
            return runner._forward(inputs)

        def forward_sample() -> Any:
            logits = runner._forward(inputs)
            if sampling is None:
                return logits.argmax(dim=-1)
            return runner.sampler(logits, sampling.temperatures, sampling.top_ks, sampling.top_ps, sampling.min_ps,
                                  sampling.seeds, sampling.steps, sampling.use_filters)

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
            for _ in range(3):
                op()
            sync(device)
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    op()
                b.record()
                torch.cuda.synchronize()
                out[label] = a.elapsed_time(b) / reps
            else:
                t = time.perf_counter()
                for _ in range(reps):
                    op()
                out[label] = 1e3 * (time.perf_counter() - t) / reps
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
    max_seqs = getattr(engine.config, "max_num_seqs", batch)
    if batch > max_seqs:
        log(f"breakdown batch {batch} > max_num_seqs {max_seqs}; using {max_seqs}")
        batch = max_seqs
    ctx = args.breakdown_context or mean_prompt
    steps, warm = args.breakdown_steps, args.breakdown_warmup
    rng = random.Random(args.seed + 2)
    params = SamplingParams(temperature=args.temperature, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                            max_tokens=warm + steps + 3, ignore_eos=True)
    for i in range(batch):
        engine.add_request([rng.randrange(facts["vocab"]) for _ in range(ctx)], params, request_id=f"probe-{i}")
    preempt0 = getattr(engine.stats, "num_preemptions", 0)
    t = time.perf_counter()
    for _ in range(100000):  # prefill every probe sequence
        if not sched.waiting and all(s.num_completion_tokens >= 1 for s in sched.running):
            break
        engine.step()
    prefill_s = time.perf_counter() - t
    running = len(sched.running)
    result: dict[str, Any] = {"batch_requested": args.breakdown_batch, "batch": running, "context": ctx,
                              "prefill_s": prefill_s}
    report.data["decode_breakdown"][name] = result
    if running != batch:
        log(f"only {running} of {batch} probe sequences run together (KV pool or max_num_seqs)")
    for _ in range(warm):
        engine.step()

    # one step with the device-time probe inside model_runner.run (not among the timed steps)
    runner = engine.model_runner
    probe: dict[str, Any] = {}
    original = runner.launch

    def launch_with_probe(seqs: list[Any], is_prefill: bool) -> Any:
        if not is_prefill and "done" not in probe:
            probe["done"] = True
            try:
                probe.update(probe_device_time(runner, seqs, args.gpu_reps, args.device))
            except Exception as exc:
                probe["error"] = f"{type(exc).__name__}: {exc}"
                print(traceback.format_exc(), file=sys.stderr, flush=True)
        return original(seqs, is_prefill)

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
        host_ms=(total_ms - gpu_ms) if gpu_ms is not None else None,
        prepare_probe_ms=probe.get("prepare_ms"),
        step_timer=(timers or {}).get("decode"),
        preemptions=getattr(engine.stats, "num_preemptions", 0) - preempt0,
        batch_tokens_per_s=running / (total_ms / 1e3),
    )
    if result["preemptions"]:
        log(f"{result['preemptions']} preemptions during the probe: the timed steps may not all be at batch {running}")
    st = result["step_timer"] or {}
    say(f"llmcli {name} decode step at batch {running}, context ~{ctx}: total {fmt_f(total_ms)} ms/step, "
        f"device (forward+sample) {fmt_f(gpu_ms)} ms, host (total - device) {fmt_f(result['host_ms'])} ms; "
        f"step timer: host {fmt_f(st.get('host_ms'))} ms, forward {fmt_f(st.get('forward_ms'))} ms")


# -- 5. transformers -----------------------------------------------------------------------------------

def hf_cb_config(args: argparse.Namespace) -> Any:
    from transformers import ContinuousBatchingConfig

    kw = json.loads(args.hf_cb_kwargs) if args.hf_cb_kwargs else {}
    if args.tiny:  # the CPU has no memory probe in some versions: size the cache by hand
        kw = {"block_size": 16, "num_blocks": 128, "max_batch_tokens": 256, **kw}
    return ContinuousBatchingConfig(**kw), kw


def hf_collect(manager: Any, expected: dict[str, int], deadline: float, label: str,
               every: float) -> tuple[dict[str, Any], str | None]:
    """Finished results by request id; stops at the deadline or if the generation thread dies."""
    got: dict[str, Any] = {}
    last = time.perf_counter()
    t0 = last
    while len(got) < len(expected):
        now = time.perf_counter()
        if now > deadline:
            return got, f"deadline reached with {len(got)}/{len(expected)} requests finished"
        if now - last >= every:
            done_tokens = sum(len(r.generated_tokens) for r in got.values())
            log(f"{label}: {len(got)}/{len(expected)} requests finished ({done_tokens:,} tokens) "
                f"after {now - t0:.0f} s")
            last = now
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                return got, f"the generation thread stopped with {len(got)}/{len(expected)} requests finished"
            continue
        if res.is_finished() and res.request_id in expected:
            got[res.request_id] = res
    return got, None


def run_hf(args: argparse.Namespace, report: Report, facts: dict[str, Any], prompts: list[list[int]],
           outs: list[int], deadline: float) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    name = facts["name"]
    entry: dict[str, Any] = {"transformers": transformers.__version__}
    report.data["transformers"][name] = entry
    dtype = DTYPES[args.dtype]
    cfg = AutoConfig.from_pretrained(facts["path"])
    cb_config, cb_kwargs = hf_cb_config(args)
    entry["cb_kwargs"] = cb_kwargs
    gen_kw: dict[str, Any] = {"max_new_tokens": max(outs), "eos_token_id": -1}
    if args.temperature > 0:
        gen_kw.update(do_sample=True, temperature=args.temperature)
    else:
        gen_kw.update(do_sample=False)
    hints = None
    with contextlib.suppress(ImportError):
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(outs),
                              num_requests=len(prompts))

    candidates = [args.hf_attn] + [a for a in (args.hf_attn_fallbacks or "").split(",") if a and a != args.hf_attn]
    model = manager = None
    for impl in candidates:
        try:
            t = time.perf_counter()
            torch.manual_seed(args.seed)
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=impl)
            model = model.to(args.device).eval()
            entry["init_s"] = time.perf_counter() - t
            kwargs: dict[str, Any] = {"generation_config": GenerationConfig(**gen_kw),
                                      "continuous_batching_config": cb_config}
            if hints is not None:
                kwargs["workload_hints"] = hints
            manager = model.init_continuous_batching(**kwargs)
            entry["attn_requested"] = impl
            break
        except Exception as exc:
            log(f"transformers with attn_implementation={impl!r} failed: {type(exc).__name__}: {exc}")
            entry.setdefault("attn_failures", []).append(f"{impl}: {type(exc).__name__}: {exc}")
            model = manager = None
            free_memory(args.device)
    if manager is None:
        raise RuntimeError(f"no attention implementation worked: {entry.get('attn_failures')}")
    entry["attn_used"] = getattr(model.config, "_attn_implementation", None)
    if entry["attn_requested"] != args.hf_attn:
        say(f"NOTE: transformers rejected attn_implementation={args.hf_attn!r}; "
            f"running with {entry['attn_requested']!r} instead")
    entry["params"] = sum(p.numel() for p in model.parameters())
    log(f"transformers {name}: model ready in {entry['init_s']:.1f} s, attention {entry['attn_used']}, "
        f"{entry['params']:,} parameters")

    incomplete = None
    try:
        with torch.no_grad():
            if hasattr(manager, "warmup"):
                t = time.perf_counter()
                manager.warmup()
                entry["cb_warmup_s"] = time.perf_counter() - t
            resolved = getattr(manager, "continuous_batching_config", None)
            if resolved is not None:
                entry["cb_config"] = {k: str(getattr(resolved, k)) for k in (
                    "block_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
                    "use_cuda_graph", "use_async_batching", "allow_block_sharing", "scheduler_type")
                    if hasattr(resolved, k)}
            manager.start()
            if args.hf_warmup_requests:
                wrng = random.Random(args.seed + 1)
                warm = {}
                for i in range(args.hf_warmup_requests):
                    rid = manager.add_request([wrng.randrange(facts["vocab"]) for _ in range(16)],
                                              request_id=f"warm-{i}", max_new_tokens=4, eos_token_id=-1)
                    warm[rid] = 4
                t = time.perf_counter()
                _, why = hf_collect(manager, warm, min(deadline, time.perf_counter() + 600), "transformers warm-up",
                                    args.progress_every)
                entry["warmup_s"] = time.perf_counter() - t
                if why:
                    raise RuntimeError(f"warm-up failed: {why}")

            expected: dict[str, int] = {}
            log(f"transformers {name}: timing {len(prompts)} requests, {sum(outs):,} output tokens "
                f"(deadline in {deadline - time.perf_counter():.0f} s)")
            sync(args.device)
            t = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, outs)):
                rid = manager.add_request(p, request_id=f"req-{i}", max_new_tokens=o, eos_token_id=-1)
                expected[rid if rid is not None else f"req-{i}"] = o
            got, incomplete = hf_collect(manager, expected, deadline, f"transformers {name}", args.progress_every)
            sync(args.device)
            wall = time.perf_counter() - t
    finally:
        with contextlib.suppress(Exception):
            manager.stop(block=True, timeout=60, hard_stop=incomplete is not None)
        with contextlib.suppress(Exception):
            if hasattr(manager, "destroy"):
                manager.destroy()
        del manager, model
        free_memory(args.device)

    ids = list(expected)
    lengths = [len(got[r].generated_tokens) if r in got else -1 for r in ids]
    errors = [f"{r}: {got[r].error}" for r in ids if r in got and getattr(got[r], "error", None)]
    tokens = sum(n for n in lengths if n > 0)
    entry.update(requests=len(prompts), finished=len(got), output_tokens=tokens, expected_output_tokens=sum(outs),
                 wall_s=wall, output_tok_s=tokens / wall, complete=incomplete is None, incomplete_reason=incomplete,
                 prompt_tokens=sum(len(p) for p in prompts))
    if incomplete is not None:
        fail(report, f"transformers {name}", f"{incomplete}; the tok/s printed is a lower bound "
                                              "(tokens of finished requests only)")
    bad = check_lengths([n for n in lengths if n >= 0], [outs[i] for i, n in enumerate(lengths) if n >= 0])
    entry["lengths_ok"] = not bad and not errors and incomplete is None
    if bad or errors:
        fail(report, f"transformers {name} output lengths", f"{len(bad)} wrong, {len(errors)} errors: "
                                                             f"{'; '.join((bad + errors)[:5])}")
    say(f"transformers {name} ({entry['attn_used']}): {tokens:,} output tokens in {wall:.2f} s = "
        f"{tokens / wall:,.0f} tok/s{'' if incomplete is None else ' (INCOMPLETE: lower bound)'}")


# -- 6. the physical bound ------------------------------------------------------------------------------

def physical_bound(facts: dict[str, Any], prompts: list[list[int]], outs: list[int], ceilings: dict[str, Any],
                   elem_bytes: int) -> dict[str, Any]:
    L, nh, nkv, hd = facts["layers"], facts["heads"], facts["kv_heads"], facts["head_dim"]
    ins = [len(p) for p in prompts]
    steps = max(outs)  # all requests run at once: decode takes as many steps as the longest output
    weight_bytes = facts["params"] * elem_bytes
    kv_per_token = 2 * L * nkv * hd * elem_bytes
    kv_tokens = sum(o * i + o * (o - 1) // 2 for i, o in zip(ins, outs))  # sum_{t<O} (I + t)
    weights_read = steps * weight_bytes
    kv_read = kv_tokens * kv_per_token
    linear_flops = 2 * facts["params_non_embedding"] * sum(ins)
    attn_flops = 4 * L * nh * hd * sum(i * i for i in ins) / 2
    bw, rate = ceilings.get("copy_bytes_per_s"), ceilings.get("matmul_flops_per_s")
    out: dict[str, Any] = {
        "elem_bytes": elem_bytes, "decode_steps": steps, "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token, "kv_tokens_read": kv_tokens, "weights_read_bytes": weights_read,
        "kv_read_bytes": kv_read, "prefill_linear_flops": linear_flops, "prefill_attention_flops": attn_flops,
        "output_tokens": sum(outs), "decode_flops_info": 2 * facts["params_non_embedding"] * sum(outs)
        + 4 * L * nh * hd * kv_tokens,
    }
    if bw and rate:
        out.update(t_weights_s=weights_read / bw, t_kv_s=kv_read / bw, t_prefill_linear_s=linear_flops / rate,
                   t_prefill_attention_s=attn_flops / rate)
        out["floor_s"] = out["t_weights_s"] + out["t_kv_s"] + out["t_prefill_linear_s"] + out["t_prefill_attention_s"]
        out["floor_tok_s"] = sum(outs) / out["floor_s"]
        out["t_decode_compute_info_s"] = out["decode_flops_info"] / rate
    return out


def print_bound(name: str, b: dict[str, Any]) -> None:
    say(f"\nphysical bound, {name}:")
    say("  floor = (decode_steps x weight_bytes + KV tokens read x kv_bytes_per_token) / copy_bw")
    say("        + (2 x params_non_embedding x prompt tokens"
        " + 4 x layers x heads x head_dim x sum(I^2)/2) / matmul_rate")
    say(f"  decode steps = max(O) = {b['decode_steps']} (assumption: all requests run concurrently)")
    say(f"  weights: {b['decode_steps']} x {b['weight_bytes'] / 1e9:.3f} GB = {b['weights_read_bytes'] / 1e12:.3f} TB"
        f" -> {fmt_f(b.get('t_weights_s'), 3)} s")
    say(f"  KV: {b['kv_tokens_read']:,} tokens x {b['kv_bytes_per_token']:,} B = {b['kv_read_bytes'] / 1e12:.3f} TB"
        f" -> {fmt_f(b.get('t_kv_s'), 3)} s")
    say(f"  prefill linear: {b['prefill_linear_flops'] / 1e12:.2f} TFLOP -> {fmt_f(b.get('t_prefill_linear_s'), 3)} s; "
        f"prefill attention: {b['prefill_attention_flops'] / 1e12:.2f} TFLOP -> "
        f"{fmt_f(b.get('t_prefill_attention_s'), 3)} s")
    say(f"  floor = {fmt_f(b.get('floor_s'), 3)} s = {fmt_f(b.get('floor_tok_s'), 0)} output tok/s "
        f"(decode compute, not in the floor as decode is memory-bound: {b['decode_flops_info'] / 1e12:.1f} TFLOP = "
        f"{fmt_f(b.get('t_decode_compute_info_s'), 3)} s at the matmul rate)")


# -- 7. the final tables --------------------------------------------------------------------------------

def final_tables(report: Report) -> str:
    d = report.data
    parts = []
    rows = []
    for name, wl in d["workloads"].items():
        hf = d["transformers"].get(name, {})
        hf_rate = hf.get("output_tok_s") if hf.get("wall_s") else None
        hf_n = hf.get("requests")
        lm = d["llmcli"].get(name, {})
        bound = d["bounds"].get(name, {})

        def row(engine: str, e: dict[str, Any], bound_s: float | None, hf_rate_same: float | None) -> list[Any]:
            rate = e.get("output_tok_s")
            vs = f"{rate / hf_rate_same:.1f}x" if rate and hf_rate_same else "n/a"
            share = f"{bound_s / e['wall_s']:.1%}" if bound_s and e.get("wall_s") else "n/a"
            return [name, engine, fmt_int(e.get("requests")), fmt_int(e.get("output_tokens")), fmt_f(e.get("wall_s")),
                    fmt_f(rate, 0), vs, share]

        if lm.get("wall_s"):
            same = hf_rate if hf_n == lm.get("requests") else None
            engine = f"llmcli ({lm.get('config', {}).get('attention_backend', '?')}" \
                     f"{', CUDA graphs' if lm.get('cuda_graphs') else ''})"
            rows.append(row(engine, lm, bound.get("floor_s"), same))
            sub = lm.get("subset")
            if sub and hf_n == sub.get("requests"):
                rows.append(row(f"llmcli, first {sub['requests']}", sub,
                                d["bounds"].get(f"{name} (first {hf_n})", {}).get("floor_s"), hf_rate))
        if hf.get("wall_s"):
            bkey = name if hf_n == wl.get("requests") else f"{name} (first {hf_n})"
            label = f"transformers {hf.get('transformers')} {hf.get('attn_used')}"
            if not hf.get("complete", True):
                label += " (INCOMPLETE, lower bound)"
            rows.append(row(label, hf, d["bounds"].get(bkey, {}).get("floor_s"), hf_rate))
        if bound.get("floor_s"):
            rows.append([name, "physical bound", fmt_int(wl.get("requests")), fmt_int(wl.get("output_tokens")),
                         fmt_f(bound["floor_s"]), fmt_f(bound["floor_tok_s"], 0),
                         f"{bound['floor_tok_s'] / hf_rate:.1f}x" if hf_rate and hf_n == wl.get("requests") else "n/a",
                         "100.0%"])
    parts.append(md_table(["model", "engine", "requests", "output tokens", "wall s", "output tok/s",
                           "vs transformers", "share of bound"], rows, right={2, 3, 4, 5, 6, 7}))

    c = d["ceilings"]
    parts.append(md_table(["ceiling", "value", "how"], [
        ["copy bandwidth (read + write)", f"{fmt_f((c.get('copy_bytes_per_s') or 0) / 1e12, 3)} TB/s",
         c.get("copy_source", "n/a")],
        ["matmul rate", f"{fmt_f((c.get('matmul_flops_per_s') or 0) / 1e12, 1)} TFLOP/s",
         c.get("matmul_source", "n/a") + (f", {c.get('dtype')} {c['matmul_n']}^3" if "matmul_n" in c else "")],
    ], right={1}))

    brows = []
    for name, b in d["bounds"].items():
        brows.append([name, b["decode_steps"], f"{b['weights_read_bytes'] / 1e12:.3f} TB",
                      fmt_f(b.get("t_weights_s"), 3), f"{b['kv_read_bytes'] / 1e12:.3f} TB", fmt_f(b.get("t_kv_s"), 3),
                      f"{(b['prefill_linear_flops'] + b['prefill_attention_flops']) / 1e12:.1f} TFLOP",
                      fmt_f((b.get("t_prefill_linear_s") or 0) + (b.get("t_prefill_attention_s") or 0)
                            if b.get("floor_s") else None, 3),
                      fmt_f(b.get("floor_s"), 3), fmt_f(b.get("floor_tok_s"), 0)])
    if brows:
        parts.append(md_table(["workload", "decode steps", "weights read", "s", "KV read", "s", "prefill FLOPs", "s",
                               "floor s", "floor tok/s"], brows))

    drows = []
    for name, b in d["decode_breakdown"].items():
        st = b.get("step_timer") or {}
        drows.append([name, b.get("batch"), b.get("context"), fmt_f(b.get("total_ms")),
                      fmt_f(b.get("gpu_forward_sample_ms")), fmt_f(b.get("host_ms")),
                      fmt_f(st.get("schedule_ms")), fmt_f(st.get("prepare_ms")), fmt_f(st.get("forward_ms")),
                      fmt_f(st.get("sample_ms")), fmt_f(st.get("postprocess_ms"))])
    if drows:
        parts.append("llmcli decode step (ms): total = wall time of engine.step(); device = forward + sample launched "
                     "back to back (CUDA events); host = total - device; the rest is the engine's step timer.\n\n"
                     + md_table(["model", "batch", "context", "total", "device", "host", "schedule", "prepare",
                                 "forward", "sample", "postprocess"], drows))

    krows = []
    for name, b in d["decode_breakdown"].items():
        groups = b.get("kernel_groups") or {}
        total = sum(g["us"] for g in groups.values()) or 1.0
        for group, row in sorted(groups.items(), key=lambda kv: -kv[1]["us"]):
            krows.append([name, b.get("batch"), group, fmt_f(row["kernels"], 0), fmt_f(row["us"] / 1e3, 3),
                          f"{100 * row['us'] / total:.1f}%"])
    if krows:
        parts.append("Where the device time of that decode step goes (the same step launched eagerly under the "
                     "profiler; kernel time only, no launch gaps):\n\n"
                     + md_table(["model", "batch", "kernel group", "kernels", "ms", "share"], krows))

    trows = []
    for name, e in d["llmcli"].items():
        for kind, st in (e.get("step_timer") or {}).items():
            phases = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in st.items() if k.endswith("_ms") and k != "host_ms")
            total = st["steps"] * sum(v for k, v in st.items() if k.endswith("_ms") and k != "host_ms") / 1e3
            trows.append([name, kind, fmt_int(st["steps"]), fmt_int(st["tokens"]), phases, f"{total:.2f} s"])
    if trows:
        parts.append("llmcli step timer over the timed run (mean ms per step by phase; a step's launch is prepare + "
                     "forward + sample, wait is the host waiting for the previous step's tokens):\n\n"
                     + md_table(["model", "step kind", "steps", "tokens", "phases", "total"], trows))
    return "\n\n".join(parts)


# -- main ------------------------------------------------------------------------------------------------

def resolve_model(path: str) -> Path:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO / p).exists():
        p = REPO / p
    return p.resolve()


def write_tiny_config() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="llmcli-bench-")) / "Qwen3-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("what to run")
    g.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="model folders (config.json suffices)")
    g.add_argument("--hf-models", nargs="*", default=None,
                   help="models to run transformers on (default: the first of --models)")
    g.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    g.add_argument("--skip-llmcli", action="store_true", help="do not run llmcli")
    g.add_argument("--skip-ceilings", action="store_true", help="do not measure copy bandwidth and matmul rate")
    g.add_argument("--skip-breakdown", action="store_true", help="do not probe llmcli's decode step")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="model dtype (default bfloat16; float32 with --tiny)")
    g.add_argument("--tiny", action="store_true",
                   help="a tiny random Qwen3 (temp dir), 8 requests of 8..32 tokens, small ceilings: a smoke test")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 with --tiny, else torch's own)")
    g.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds for the whole script; transformers stops at it (its tok/s then a lower bound)")
    g.add_argument("--json-out", default=None, help="JSON path (default: $OUT/bench.json when OUT is set)")
    g.add_argument("--progress-every", type=float, default=15.0, help="seconds between progress lines on stderr")

    w = ap.add_argument_group("workload (llmcli bench's default)")
    w.add_argument("--num-prompts", type=int, default=256)
    w.add_argument("--min-input", type=int, default=100)
    w.add_argument("--max-input", type=int, default=1024)
    w.add_argument("--min-output", type=int, default=100)
    w.add_argument("--max-output", type=int, default=1024)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    w.add_argument("--warmup-requests", type=int, default=4, help="llmcli warm-up requests (16 in, 4 out)")

    e = ap.add_argument_group("llmcli engine (default: the engine's own)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton", "flash-attn"])
    e.add_argument("--kvcache-block-size", type=int, default=None)
    e.add_argument("--num-kvcache-blocks", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)

    b = ap.add_argument_group("decode step breakdown")
    b.add_argument("--breakdown-batch", type=int, default=256)
    b.add_argument("--breakdown-context", type=int, default=None, help="prompt tokens (default: mean prompt length)")
    b.add_argument("--breakdown-steps", type=int, default=30, help="engine steps timed")
    b.add_argument("--breakdown-warmup", type=int, default=5)
    b.add_argument("--gpu-reps", type=int, default=20, help="back-to-back forwards timed for the device time")

    c = ap.add_argument_group("ceilings")
    c.add_argument("--copy-gib", type=float, default=2.0, help="size of the copied tensor (GiB)")
    c.add_argument("--matmul-n", type=int, default=8192)
    c.add_argument("--ceiling-reps", type=int, default=20)
    c.add_argument("--ceiling-dtype", default=None, choices=list(DTYPES), help="default: bfloat16 (float32 on CPU)")
    c.add_argument("--copy-bw", type=float, default=None, help="TB/s: use this instead of measuring")
    c.add_argument("--matmul-tflops", type=float, default=None, help="TFLOP/s: use this instead of measuring")

    h = ap.add_argument_group("transformers")
    h.add_argument("--hf-attn", default="paged|sdpa", help="attn_implementation")
    h.add_argument("--hf-attn-fallbacks", default="sdpa", help="comma list tried if --hf-attn is rejected")
    h.add_argument("--hf-max-prompts", type=int, default=None,
                   help="run transformers on the first N requests only (llmcli is then timed on them too)")
    h.add_argument("--hf-cb-kwargs", default="", help="JSON of ContinuousBatchingConfig fields")
    h.add_argument("--hf-warmup-requests", type=int, default=4)
    args = ap.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible")
    if args.tiny:
        defaults = {"num_prompts": 256, "min_input": 100, "max_input": 1024, "min_output": 100, "max_output": 1024,
                    "breakdown_batch": 256, "breakdown_steps": 30, "gpu_reps": 20, "copy_gib": 2.0, "matmul_n": 8192,
                    "ceiling_reps": 20, "num_kvcache_blocks": None, "kvcache_block_size": None, "breakdown_warmup": 5}
        tiny = {"num_prompts": 8, "min_input": 8, "max_input": 32, "min_output": 8, "max_output": 32,
                "breakdown_batch": 8, "breakdown_steps": 5, "gpu_reps": 3, "copy_gib": 1 / 16, "matmul_n": 256,
                "ceiling_reps": 5, "num_kvcache_blocks": 128, "kvcache_block_size": 16, "breakdown_warmup": 2}
        for k, v in tiny.items():
            if getattr(args, k) == defaults[k]:  # only where the user kept the default
                setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.cpu_threads is None and args.tiny:
        args.cpu_threads = 1  # a busy small CPU stalls for milliseconds in every multi-threaded op
    if args.ceiling_dtype is None:
        args.ceiling_dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.device == "cpu" and args.dtype == "float16":
        ap.error("float16 is not supported on CPU")
    lengths_ok = 1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output
    if not lengths_ok or args.num_prompts < 1:
        ap.error("need 1 <= min <= max for input and output lengths, and --num-prompts >= 1")
    return args


def meta(args: argparse.Namespace) -> dict[str, Any]:
    m: dict[str, Any] = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
                         "python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "host": platform.node(), "platform": platform.platform()}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        m.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    for mod in ("transformers", "triton", "llmcli"):
        with contextlib.suppress(Exception):
            m[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        m["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                         timeout=10).stdout.strip()
        m["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                             text=True, timeout=10).stdout.strip())
    return m


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = os.environ.get("OUT")
    json_path = Path(args.json_out) if args.json_out else (Path(out_dir) / "bench.json" if out_dir else None)
    report = Report(json_path)
    deadline = START + args.time_budget
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    llmcli_log = logging.getLogger("llmcli")
    if not llmcli_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("llmcli %(levelname)s: %(message)s"))
        llmcli_log.addHandler(handler)
        llmcli_log.setLevel(logging.INFO)
    report.data["meta"] = meta(args)
    say(f"bench_vs_hf: {report.data['meta'].get('gpu', 'cpu')}, torch {torch.__version__}, "
        f"transformers {report.data['meta'].get('transformers', '?')}, dtype {args.dtype}")
    report.save()

    models = [resolve_model(m) for m in args.models]
    if args.tiny:
        models = [write_tiny_config()]
        say(f"tiny mode: random Qwen3 config in {models[0]}")
    hf_models = models[:1] if args.hf_models is None else [resolve_model(m) for m in args.hf_models]
    if args.tiny:
        hf_models = models[:1] if args.hf_models is None or args.hf_models else []
    if args.skip_hf:
        hf_models = []

    if not args.skip_ceilings or (args.copy_bw is not None and args.matmul_tflops is not None):
        section(report, "ceilings", measure_ceilings, args, report)

    workloads: dict[str, tuple[dict[str, Any], list[list[int]], list[int]]] = {}

    def build(model_dir: Path) -> None:
        facts = model_facts(model_dir)
        prompts, outs, source = make_workload(args, facts)
        workloads[facts["name"]] = (facts, prompts, outs)
        report.data["workloads"][facts["name"]] = {**describe_workload(prompts, outs), "generator": source,
                                                   "model": facts}
        say(f"workload {facts['name']}: {len(prompts)} requests, {sum(len(p) for p in prompts):,} prompt tokens, "
            f"{sum(outs):,} output tokens (max output {max(outs)}), {facts['params']:,} parameters")

    for m in dict.fromkeys(models + hf_models):
        section(report, f"workload {m.name}", build, m)

    def subset_for(name: str) -> int | None:
        n = len(workloads[name][1])
        hf_names = {m.name for m in hf_models}
        return args.hf_max_prompts if name in hf_names and args.hf_max_prompts and args.hf_max_prompts < n else None

    def bounds() -> None:
        elem = DTYPES[args.dtype].itemsize
        for name, (facts, prompts, outs) in workloads.items():
            b = physical_bound(facts, prompts, outs, report.data["ceilings"], elem)
            report.data["bounds"][name] = b
            print_bound(name, b)
            sub = subset_for(name)
            if sub:
                report.data["bounds"][f"{name} (first {sub})"] = physical_bound(facts, prompts[:sub], outs[:sub],
                                                                                report.data["ceilings"], elem)

    section(report, "physical bound", bounds)

    # Model by model, llmcli then transformers, so the pair of the first model is done first.
    hf_names = {m.name for m in hf_models}
    llmcli_names = set() if args.skip_llmcli else {m.name for m in models}
    for m in dict.fromkeys(models + hf_models):
        for engine in ("llmcli", "transformers"):
            if m.name not in (llmcli_names if engine == "llmcli" else hf_names):
                continue
            label = f"{engine} {m.name}"
            if m.name not in workloads:
                fail(report, label, "no workload (see the failure above)")
                continue
            left = deadline - time.perf_counter() - 30  # teardown and the report
            if left < 60:
                fail(report, label, f"skipped: only {left:.0f} s left of --time-budget {args.time_budget:.0f}")
                continue
            facts, prompts, outs = workloads[m.name]
            if engine == "llmcli":
                section(report, label, run_llmcli, args, report, facts, prompts, outs, subset_for(m.name))
            else:
                n = args.hf_max_prompts or len(prompts)
                section(report, label, run_hf, args, report, facts, prompts[:n], outs[:n], time.perf_counter() + left)

    table = final_tables(report)
    report.data["markdown"] = table
    report.data["total_s"] = time.perf_counter() - START
    report.save()
    say("\n## Results\n")
    say(table)
    failures = report.data["failures"]
    say(f"\n{len(failures)} failure(s){': ' + '; '.join(f['section'] for f in failures) if failures else ''}; "
        f"total {report.data['total_s']:.0f} s" + (f"; JSON in {json_path}" if json_path else ""))
    if out_dir:
        with contextlib.suppress(OSError):
            (Path(out_dir) / "bench.md").write_text(table + "\n")
    if args.tiny:
        shutil.rmtree(models[0].parent, ignore_errors=True)
    code = 1 if failures else 0
    stray = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if stray:  # a generation thread that did not stop must not keep the process alive
        log(f"exiting past {len(stray)} live thread(s): {[t.name for t in stray]}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
