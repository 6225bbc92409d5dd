"""Data parallelism on GPUs (issue #17): ``llmcli generate`` with replicas, on the default workload as JSONL.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks.harness.cli_process import CLI, GpuWatch, gpu_memory_mib, watch_command  # noqa: E402
from benchmarks.harness.output import fmt_f, md_table, out_path, write_json  # noqa: E402
from benchmarks.harness.script_args import add_device_args, keep_defaults, settle_device  # noqa: E402
from benchmarks.harness.workload import (  # noqa: E402
    add_workload_args, make_workload, model_facts, write_requests_jsonl, write_tiny_config)
from processes import env, wait_gone  # noqa: E402

ALL_PARTS = ("one-gpu", "dp", "tp-vs-dp", "ray")
RUN_TIMEOUT_S = 300.0  # per llmcli generate


@dataclass
class Run:
    label: str
    model: str
    dp: int
    tp: int
    backend: str
    flags: list[str]
    exit_status: int | None = None
    seconds: float = 0.0
    generation_s: float | None = None
    records: int = 0
    expected: int = 0
    exactly_once: bool = False
    output_tokens: int = 0
    tok_s: float | None = None
    identical: str = "n/a"
    replica_lines: list[str] = field(default_factory=list)  # the driver's log lines about its replicas
    gpus: dict[str, dict[str, int]] = field(default_factory=dict)
    processes_left: list[int] = field(default_factory=list)
    gpu_mib_left: dict[str, int] = field(default_factory=dict)
    message: str = ""
    stderr_tail: str = ""


def read_outputs(out: Path) -> dict[int, list[int]]:
    answers: dict[int, list[int]] = {}
    for line in out.read_bytes().splitlines() if out.exists() else []:
        record = json.loads(line)
        if record["id"] in answers:
            raise AssertionError(f"record {record['id']} written twice")
        answers[record["id"]] = record.get("token_ids") or []
    return answers


def generate(label: str, args: argparse.Namespace, model: str, jsonl: Path, folder: Path, *, dp: int = 1,
             tp: int = 1, backend: str = "local", force_pool: bool = False) -> tuple[Run, dict[int, list[int]]]:
    """One ``llmcli generate``, checked: records exactly once, nothing left behind."""
    out = folder / f"{re.sub(r'[^A-Za-z0-9]+', '-', label)}.jsonl"
    flags = ["--load-format", "dummy", "--include-token-ids", "--unordered", "--overwrite", "--device", args.device,
             *args.engine_flags]
    flags += ["--data-parallel-size", str(dp)] if dp > 1 or force_pool or backend != "local" else []
    flags += ["--distributed-backend", backend] if backend != "local" else []
    flags += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    run = Run(label, Path(model).name, dp, tp, backend, flags, expected=jsonl.read_bytes().count(b"\n"))
    run_env = env()  # this checkout importable, no network
    if args.device == "cuda":  # host threads as the user would have them (env() pins one, for the CPU tests)
        run_env.pop("OMP_NUM_THREADS", None)
        run_env.update({k: v for k, v in os.environ.items() if k == "OMP_NUM_THREADS"})
    if force_pool:
        run_env["LLMCLI_DP_FORCE_POOL"] = "1"
    print(f"-- {label}: llmcli generate ... {' '.join(flags)}" + (" (LLMCLI_DP_FORCE_POOL=1)" if force_pool else ""),
          flush=True)
    before = gpu_memory_mib()
    cmd = [sys.executable, "-c", CLI, "generate", str(jsonl), "-o", str(out), "--model", model, *flags]
    with tempfile.TemporaryFile("w+") as err, GpuWatch() as watch:
        proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        seen, timed_out, run.seconds = watch_command(proc, RUN_TIMEOUT_S)
        run.exit_status = proc.returncode
        run.message = f"no exit within {RUN_TIMEOUT_S:.0f} s: killed" if timed_out else ""
        err.seek(0)
        stderr = err.read()
    run.processes_left = wait_gone(list(seen), 15)
    time.sleep(1.0 if watch.enabled else 0)  # the driver's CUDA context goes with it; let nvidia-smi see that
    after = gpu_memory_mib()
    run.gpu_mib_left = {g: after[g] - before.get(g, 0) for g in after if after[g] - before.get(g, 0) > 256}
    run.gpus = {g: {"before_mib": before.get(g, 0), "peak_mib": watch.gpu_peak.get(g, 0), "after_mib": after[g]}
                for g in after}
    run.replica_lines = re.findall(r"(data-parallel replica \d+.*)", stderr)
    answers: dict[int, list[int]] = {}
    try:
        answers = read_outputs(out)
    except (AssertionError, ValueError, KeyError) as exc:
        run.message = run.message or f"bad output: {exc}"
    run.records = len(answers)
    run.exactly_once = sorted(answers) == list(range(run.expected)) and not run.message
    run.output_tokens = sum(len(ids) for ids in answers.values())
    match = re.search(r"generation time\s*\S\s*([\d,.]+)", stderr)  # from the CLI's summary table
    run.generation_s = float(match.group(1).replace(",", "")) if match else None
    run.tok_s = run.output_tokens / run.generation_s if run.generation_s else None
    if run.exit_status != 0 and not run.message:
        lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("llmcli log")]
        run.message = lines[-1][:300] if lines else f"exit {run.exit_status}"
    run.stderr_tail = stderr[-3000:]
    print(f"   exit {run.exit_status} in {run.seconds} s; {run.records}/{run.expected} records, "
          f"{run.output_tokens:,} tokens, generation {run.generation_s} s" + (f"; {run.message}" if run.message else ""),
          *(f"\n   {line}" for line in run.replica_lines), flush=True)
    return run, answers


def compare(run: Run, answers: dict[int, list[int]], base: dict[int, list[int]] | None, base_label: str) -> None:
    if run.tp > 1:  # with dummy weights each tensor-parallel rank draws its own shard: another model
        run.identical = "n/a (dummy weights differ at TP>1)"
    elif base:
        same = sum(1 for i, ids in answers.items() if base.get(i) == ids)
        run.identical = f"{same}/{len(base)} vs {base_label}" + ("" if same == len(base) else " NO")


def write_workload(model: str, args: argparse.Namespace, path: Path) -> Path:
    """``llmcli bench``'s default workload (its own generator) as JSONL: token ids, max_tokens, EOS ignored."""
    prompts, outs, _ = make_workload(args, model_facts(Path(model)))
    return write_requests_jsonl(path, zip(prompts, outs), ignore_eos=True, temperature=args.temperature)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=ALL_PARTS, default=None,
                    help="default: one-gpu with one GPU, everything else with two or more")
    ap.add_argument("--models", nargs="+", default=[str(REPO / "configs" / "Qwen3-0.6B"),
                                                    str(REPO / "configs" / "Qwen3-8B")],
                    help="the first runs one-gpu and ray; all run dp; the last runs tp-vs-dp")
    add_device_args(ap, device="cuda", tiny="a tiny random Qwen3 and a small workload",
                    smoke="the CI smoke test: --device cpu --tiny, one-gpu")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    settle_device(ap, args)
    if args.smoke:
        args.parts = args.parts or ["one-gpu"]
    if args.tiny:
        keep_defaults(ap, args, {"num_prompts": 16, "min_input": 8, "max_input": 32, "min_output": 16,
                                 "max_output": 48})
    # on a CPU a small KV pool, two sequences at a time: a tiny model's run in seconds
    args.engine_flags = ["--num-kvcache-blocks", "128", "--kvcache-block-size", "16", "--max-num-seqs", "2"] \
        if args.device == "cpu" else []
    return args


def table(runs: list[Run]) -> str:
    rows, base_rate = [], {}
    for r in runs:
        if r.dp == 1 and r.tp == 1 and r.backend == "local" and r.tok_s:
            base_rate.setdefault(r.model, r.tok_s)
    for r in runs:
        ratio = f"{r.tok_s / base_rate[r.model]:.2f}x" if r.tok_s and r.model in base_rate else "n/a"
        peaks = ", ".join(f"{g}: {v['peak_mib'] / 1024:.1f}" for g, v in r.gpus.items()) or "n/a"
        left = f"{len(r.processes_left)}, " + (", ".join(f"GPU {g} +{m / 1024:.1f}" for g, m in r.gpu_mib_left.items())
                                               or "0")
        rows.append([r.label, r.model, f"{r.dp} x {r.tp}", r.backend, r.exit_status, f"{r.records}/{r.expected} "
                     f"({'yes' if r.exactly_once else 'NO'})", f"{r.output_tokens:,}", fmt_f(r.generation_s),
                     fmt_f(r.tok_s, 0), ratio, r.identical, peaks, left])
    return md_table(["run", "model", "DP x TP", "backend", "exit", "records (exactly once)", "output tokens",
                     "generation s", "output tok/s", "vs DP=1", "identical", "GPUs: peak GiB", "left: processes, GiB"],
                    rows, right={4, 6, 7, 8, 9})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    parts = args.parts or (["one-gpu"] if args.device == "cuda" and gpus < 2 else ["dp", "tp-vs-dp", "ray"])
    if args.device == "cuda" and gpus < 2 and any(p != "one-gpu" for p in parts):
        print(f"only {gpus} GPU visible: skipping {[p for p in parts if p != 'one-gpu']} (they need two)", flush=True)
        parts = [p for p in parts if p == "one-gpu"]
    folder = Path(tempfile.mkdtemp(prefix="llmcli-dp-"))
    models = [str(write_tiny_config(folder))] if args.tiny else args.models
    print(f"dp_gpu: {gpus} GPU(s) visible, device {args.device}; parts {parts}; models "
          f"{[Path(m).name for m in models]}", flush=True)
    started = time.monotonic()
    runs: list[Run] = []
    workloads = {m: write_workload(m, args, folder / f"{Path(m).name}.jsonl") for m in dict.fromkeys(models)}
    first, last = models[0], models[-1]
    baselines: dict[str, dict[int, list[int]]] = {}

    def plain(model: str) -> dict[int, list[int]]:
        if model not in baselines:
            run, answers = generate(f"DP=1 {Path(model).name}", args, model, workloads[model], folder)
            runs.append(run)
            baselines[model] = answers if run.exactly_once else {}
        return baselines[model]

    def against_plain(label: str, model: str, base_label: str = "DP=1", **how: Any) -> Run:
        base = plain(model)
        run, answers = generate(f"{label} {Path(model).name}", args, model, workloads[model], folder, **how)
        compare(run, answers, base, base_label)
        runs.append(run)
        return run

    try:
        if "one-gpu" in parts:
            against_plain("DP=1 via the pool", first, "plain engine", force_pool=True)
        for model in models if "dp" in parts else []:
            against_plain("DP=2", model, dp=2)
        if "tp-vs-dp" in parts:
            if not any(r.dp == 2 and r.model == Path(last).name for r in runs):
                against_plain("DP=2", last, dp=2)
            against_plain("TP=2", last, tp=2)
        if "ray" in parts:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("ray: skipped (Ray is not installed here)", flush=True)
            else:
                against_plain("DP=2 Ray", first, dp=2, backend="ray")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        write_json(out_path("dp.json"), {"parts": parts, "gpus": gpus, "seconds": round(time.monotonic() - started, 1),
                                         "runs": [asdict(r) for r in runs]})
    print(f"\n## Data parallelism ({time.monotonic() - started:.0f} s)\n")
    print(table(runs))
    bad = [r.label for r in runs if r.exit_status != 0 or r.identical.endswith("NO") or not r.exactly_once
           or r.processes_left or r.message]
    print(f"\n{len(bad)} failed run(s){': ' + '; '.join(bad) if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
