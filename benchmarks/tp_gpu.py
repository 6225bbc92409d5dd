"""Tensor parallelism on GPUs (issue #5): TP=2 vs TP=1 greedy agreement in bf16, and Qwen3-8B throughput at TP=1/2.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # tests/: the GPU tests' checkpoint writer and greedy comparisons

BENCH_MODEL = str(REPO / "configs" / "Qwen3-8B")

import torch  # noqa: E402
from benchmarks.harness.output import out_path, write_json  # noqa: E402
from greedy_compare import agreement  # noqa: E402
from tiny_qwen3 import write_random_published  # noqa: E402


def greedy(path: Path, prompts: list[list[int]], tp: int, new_tokens: int,
           forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[list[int]] | None]:
    """Free-running greedy outputs at this TP size; with ``forced``, also the teacher-forced tokens."""
    from greedy_compare import regroup, teacher_forced_prompts
    from llmcli import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_model_len=2048)
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        free = [o.token_ids for o in llm.generate(prompts, params)]
        if forced is None:
            return free, None
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        flat = [o.token_ids[0] for o in llm.generate(teacher_forced_prompts(prompts, forced), one)]
        return free, regroup(flat, new_tokens)
    finally:
        llm.shutdown()
        torch.cuda.empty_cache()


def bench(model: str, tp: int, timeout_s: float = 240) -> dict:
    cmd = [sys.executable, "-m", "llmcli", "bench", "--model", model, "--load-format", "dummy",
           "--tensor-parallel-size", str(tp), "--json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--stack-dump-after", type=float, default=0,
                        help="print every thread's stack after this many seconds (to see where a hang sits)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.stack_dump_after:
        faulthandler.dump_traceback_later(args.stack_dump_after)
    report: dict = {}
    if not args.skip_agreement:
        rng = random.Random(0)
        prompts = [[rng.randrange(151936) for _ in range(rng.randint(8, 700))] for _ in range(args.prompts)]
        with tempfile.TemporaryDirectory() as tmp:
            # the GPU tests' writer: the same weights as tests/test_gpu_e2e.py's
            path = write_random_published(REPO / "configs" / "Qwen3-0.6B" / "config.json", Path(tmp))
            torch.cuda.empty_cache()  # the engine sizes its KV pool from free memory
            print(f"checkpoint written; greedy at TP={args.tp[0]}", flush=True)
            base, _ = greedy(path, prompts, args.tp[0], args.new_tokens)
            runs = {}
            for tp in args.tp[1:]:
                print(f"greedy at TP={tp}", flush=True)
                runs[tp] = greedy(path, prompts, tp, args.new_tokens, forced=base)
        first = args.tp[0]
        report["agreement"] = {
            f"tp{tp} vs tp{first}": {"free_running": agreement(free, base), "teacher_forced": agreement(forced, base)}
            for tp, (free, forced) in runs.items()}
        print(f"greedy agreement (bf16, {args.prompts} prompts x {args.new_tokens} tokens; teacher-forced: each "
              f"position given tp{first}'s own prefix):", json.dumps(report["agreement"]))
    faulthandler.cancel_dump_traceback_later()  # the timer watches the in-process engines only
    if not args.skip_bench:
        report["bench"] = {}
        for tp in args.tp:
            print(f"llmcli bench {Path(BENCH_MODEL).name} at TP={tp}", flush=True)
            report["bench"][tp] = bench(BENCH_MODEL, tp)
        print("\n| model | TP | output tok/s | total tok/s | requests/s | TTFT p50 ms | TPOT p50 ms | decode steps "
              "| decode step ms: host launch / wait for tokens |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for tp, r in report["bench"].items():
            if "error" in r:
                print(f"| {Path(BENCH_MODEL).name} | {tp} | FAILED: {r['error']} | | | | | | |")
                continue
            d = (r.get("step_timer") or {}).get("decode", {})
            launch = sum(d.get(f"{phase}_ms", 0.0) for phase in ("prepare", "forward", "sample"))
            print(f"| {Path(BENCH_MODEL).name} | {tp} | {r['output_tokens_per_s']:,.0f} | "
                  f"{r['total_tokens_per_s']:,.0f} | {r['requests_per_s']:.2f} | {r['ttft_ms']['p50']:.0f} | "
                  f"{r['tpot_ms']['p50']:.1f} | {d.get('steps', 0):,} | {launch:.2f} / {d.get('wait_ms', 0.0):.2f} |")
    write_json(out_path("tp.json"), report)


if __name__ == "__main__":
    main()
