#!/usr/bin/env python
"""llmcli against HuggingFace transformers' own continuous batching, in one process, on one GPU.

What it measures, its options and how to run it: benchmarks/README.md.
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
sys.path.insert(0, str(REPO))

from benchmarks.harness.bound import physical_bound, print_bound  # noqa: E402
from benchmarks.harness.ceilings import DTYPES, measure_ceilings  # noqa: E402
from benchmarks.harness.hf_run import run_hf  # noqa: E402
from benchmarks.harness.llmcli_run import run_llmcli  # noqa: E402
from benchmarks.harness.output import START, log, out_path, say  # noqa: E402
from benchmarks.harness.report import Report, fail, final_tables, section  # noqa: E402
from benchmarks.harness.script_args import add_device_args, keep_defaults, settle_device  # noqa: E402
from benchmarks.harness.workload import (  # noqa: E402
    DEFAULT_MODELS, add_workload_args, make_workload, model_facts, resolve_model, write_tiny_config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("what to run")
    g.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="model folders (config.json suffices)")
    g.add_argument("--skip-hf", action="store_true", help="do not run transformers (it runs on the first model)")
    g.add_argument("--skip-breakdown", action="store_true", help="do not probe llmcli's decode step")
    g.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="model dtype (default bfloat16; float32 with --tiny)")
    add_device_args(g, tiny="a tiny random Qwen3 (temp dir), 8 requests of 8..32 tokens, small ceilings")
    g.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds for the whole script; transformers stops at it (its tok/s then a lower bound)")
    w = ap.add_argument_group("workload (llmcli bench's default)")
    add_workload_args(w)
    e = ap.add_argument_group("llmcli")
    e.add_argument("--engine", nargs="*", default=[], metavar="NAME=VALUE",
                   help="engine settings (e.g. max_num_seqs=512 enforce_eager); default: the engine's own")
    e.add_argument("--breakdown-batch", type=int, default=256)
    e.add_argument("--breakdown-steps", type=int, default=30, help="engine steps timed")
    h = ap.add_argument_group("transformers")
    h.add_argument("--hf-attn", default="paged|sdpa", help="attn_implementation (sdpa if transformers rejects it)")
    h.add_argument("--hf-max-prompts", type=int, default=None,
                   help="run transformers on the first N requests only (llmcli is then timed on them too)")
    args = ap.parse_args(argv)
    settle_device(ap, args)
    if args.tiny:
        keep_defaults(ap, args, {"num_prompts": 8, "min_input": 8, "max_input": 32, "min_output": 8,
                                 "max_output": 32, "breakdown_batch": 8, "breakdown_steps": 5})
        args.engine = ["num_kvcache_blocks=128", "kvcache_block_size=16", *args.engine]
        torch.set_num_threads(1)  # a busy small CPU stalls for milliseconds in every multi-threaded op
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.device == "cpu" and args.dtype == "float16":
        ap.error("float16 is not supported on CPU")
    lengths_ok = 1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output
    if not lengths_ok or args.num_prompts < 1:
        ap.error("need 1 <= min <= max for input and output lengths, and --num-prompts >= 1")
    return args


def meta(args: argparse.Namespace) -> dict[str, Any]:
    m: dict[str, Any] = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
                         "python": platform.python_version(), "cuda": torch.version.cuda, "host": platform.node()}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        m.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    for mod in ("torch", "transformers", "triton", "llmcli"):
        with contextlib.suppress(Exception):
            m[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        m["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                  text=True, timeout=10).stdout.strip()
    return m


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path, md_path = out_path("bench.json"), out_path("bench.md")
    report = Report(json_path)
    deadline = START + args.time_budget
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")  # other loggers stay at WARNING
    logging.getLogger("llmcli").setLevel(logging.INFO)
    report.data["meta"] = meta(args)
    say(f"bench_vs_hf: {report.data['meta'].get('gpu', 'cpu')}, torch {torch.__version__}, "
        f"transformers {report.data['meta'].get('transformers', '?')}, dtype {args.dtype}")
    report.save()

    models = [resolve_model(m) for m in args.models]
    if args.tiny:
        models = [write_tiny_config()]
        say(f"tiny mode: random Qwen3 config in {models[0]}")
    hf_name = None if args.skip_hf else models[0].name  # transformers runs on the first model only
    section(report, "ceilings", lambda: report.data["ceilings"].update(measure_ceilings(args.device, args.tiny)))

    workloads: dict[str, tuple[dict[str, Any], list[list[int]], list[int]]] = {}

    def build(model_dir: Path) -> None:
        facts = model_facts(model_dir)
        prompts, outs, source = make_workload(args, facts)
        workloads[facts["name"]] = (facts, prompts, outs)
        report.data["workloads"][facts["name"]] = {"requests": len(prompts), "output_tokens": sum(outs),
                                                   "prompt_tokens": sum(map(len, prompts)), "generator": source,
                                                   "model": facts}
        say(f"workload {facts['name']}: {len(prompts)} requests, {sum(len(p) for p in prompts):,} prompt tokens, "
            f"{sum(outs):,} output tokens (max output {max(outs)}), {facts['params']:,} parameters")

    for m in models:
        section(report, f"workload {m.name}", build, m)

    def subset_for(name: str) -> int | None:
        n = args.hf_max_prompts
        return n if name == hf_name and n and n < len(workloads[name][1]) else None

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
    for m in models:
        for engine in ("llmcli", "transformers") if m.name == hf_name else ("llmcli",):
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
    if md_path:
        with contextlib.suppress(OSError):
            md_path.write_text(table + "\n")
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
