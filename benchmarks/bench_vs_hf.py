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
    python benchmarks/bench_vs_hf.py --smoke                  # seconds on a CPU: a tiny random Qwen3

Exit status 0 when every section passed, 1 when any printed FAILED. See benchmarks/README.md.
The parts live in benchmarks/harness/, one job a module; this file holds the options and the order of the
sections.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.bound import physical_bound, print_bound  # noqa: E402
from benchmarks.harness.ceilings import DTYPES, measure_ceilings  # noqa: E402
from benchmarks.harness.hf_run import run_hf  # noqa: E402
from benchmarks.harness.llmcli_run import run_llmcli  # noqa: E402
from benchmarks.harness.output import START, log, say  # noqa: E402
from benchmarks.harness.report import Report, fail, final_tables, section  # noqa: E402
from benchmarks.harness.workload import (  # noqa: E402
    DEFAULT_MODELS, add_workload_args, describe_workload, make_workload, model_facts, resolve_model, write_tiny_config)


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
    g.add_argument("--smoke", action="store_true", help="the CI smoke test: --device cpu --tiny")
    g.add_argument("--tiny", action="store_true",
                   help="a tiny random Qwen3 (temp dir), 8 requests of 8..32 tokens, small ceilings: a smoke test")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 with --tiny, else torch's own)")
    g.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds for the whole script; transformers stops at it (its tok/s then a lower bound)")
    g.add_argument("--json-out", default=None, help="JSON path (default: $OUT/bench.json when OUT is set)")
    g.add_argument("--progress-every", type=float, default=15.0, help="seconds between progress lines on stderr")

    w = ap.add_argument_group("workload (llmcli bench's default)")
    add_workload_args(w)
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
    if args.smoke:
        args.device, args.tiny = "cpu", True
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
