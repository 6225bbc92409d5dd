#!/usr/bin/env python
"""Issue 27's GPU check in one call: do the new families run as fast as Qwen3, and agree with transformers?

1. ``bench_vs_hf.py`` (llmcli only, dummy weights, ``llmcli bench``'s default workload) on Llama-3.1-8B and
   Qwen2.5-7B next to Qwen3-8B in the same run, with the physical bound of each (its weights, KV and FLOPs at
   the machine's measured ceilings): each family's share of its bound must be at least 97% of Qwen3-8B's.
2. ``tests/test_gpu_e2e.py`` on a random-weight Llama-3.2-1B (llama3 rope, the fused kernel's rotary-only
   form, tied embeddings): bf16 greedy agreement with transformers.

Prints one table (model, output tok/s, share of bound, relative to Qwen3-8B) and exits 1 when a share falls
short, the e2e test fails, or the benchmark reports a failure.

    python benchmarks/families_gpu.py            # the GPU run (about 4-5 minutes on one H200)
    python benchmarks/families_gpu.py --smoke    # CPU, seconds: tiny checkpoints of three families, no e2e
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = ["configs/Llama-3.1-8B", "configs/Qwen2.5-7B", "configs/Qwen3-8B"]
TOLERANCE = 0.03  # a family's share of its bound may trail Qwen3's by 3% of it


def shares(bench: dict) -> dict[str, tuple[float, float]]:
    """model -> (output tok/s, share of the physical bound) from bench_vs_hf's JSON."""
    found = {}
    for name, run in bench["llmcli"].items():
        floor = bench["bounds"].get(name, {}).get("floor_s")
        if run.get("wall_s") and floor:
            found[name] = (run["output_tok_s"], floor / run["wall_s"])
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny checkpoints, a tiny workload, no e2e test")
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="families-"))
    bench_args = ["--skip-hf", "--skip-breakdown", "--json-out", str(out / "families.json")]
    if args.smoke:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_qwen3 import write_tiny_model

        tmp = Path(tempfile.mkdtemp(prefix="families-smoke-"))
        models = [str(write_tiny_model(tmp / name, family)) for name, family in
                  (("Llama-tiny", "llama"), ("Qwen2-tiny", "qwen2"), ("Qwen3-tiny", "qwen3"))]
        bench_args += ["--device", "cpu", "--dtype", "float32", "--num-prompts", "8", "--min-input", "8",
                       "--max-input", "32", "--min-output", "8", "--max-output", "32", "--copy-gib", "0.0625",
                       "--matmul-n", "256", "--ceiling-reps", "5", "--num-kvcache-blocks", "128",
                       "--kvcache-block-size", "16", "--cpu-threads", "1"]
    else:
        models = MODELS
    code = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vs_hf.py"), "--models", *models,
                           *bench_args], cwd=REPO).returncode
    found = shares(json.loads((out / "families.json").read_text()))
    reference = Path(models[-1]).name
    failed = code != 0 or reference not in found
    print("\n| model | output tok/s | share of bound | vs " + reference + " |\n|---|---:|---:|---:|")
    for model in models:
        name = Path(model).name
        if name not in found:
            print(f"| {name} | FAILED | | |")
            failed = True
            continue
        rate, share = found[name]
        ratio = share / found[reference][1] if reference in found else float("nan")
        short = not args.smoke and ratio < 1 - TOLERANCE  # CPU timings of tiny models say nothing about speed
        failed |= short
        print(f"| {name} | {rate:,.0f} | {share:.1%} | {ratio:.3f}{' SHORT' if short else ''} |")
    if not args.smoke:
        e2e = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "tests/test_gpu_e2e.py", "-k", "Llama"],
                             cwd=REPO).returncode
        print(f"GPU e2e agreement on Llama-3.2-1B: {'passed' if e2e == 0 else 'FAILED'}")
        failed |= e2e != 0
    print("families: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
