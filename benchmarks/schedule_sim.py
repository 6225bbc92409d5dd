#!/usr/bin/env python
"""The scheduler alone on a workload (no model, no device): how many steps of each kind it plans, how full its
decode batches are, and with a per-step cost model an estimated wall time, with and without admission groups.

A scheduling policy's effect can be read here before any device time is spent on it: on 2026-12-04 this
predicted the 13 mixed steps Qwen3.6-27B then ran on an H200 (`benchmarks/RESULTS.md` R2). The cost model's
defaults are that model's (R1/R2: a decode step 25 ms + 18 ms per 209 rows, a mixed step ~250 ms of host time
more, prefill at ~0.1 ms a token); give your own for another model.

    python benchmarks/schedule_sim.py --max-num-seqs 209
    python benchmarks/schedule_sim.py --max-num-seqs 1024 --num-blocks 15600 --row-pages 37

The second is a hybrid model's pool (engine/state_pages.py): ``--num-blocks`` pages of which each sequence's
states take ``--row-pages`` while it runs (the 27B's: 147 MiB in 4 MiB blocks of 64 tokens), max_num_seqs
lowered as the runner lowers it to what fits beside one sequence of ``--max-model-len``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from benchmarks.harness.output import md_table  # noqa: E402
from benchmarks.harness.workload import add_workload_args, make_workload  # noqa: E402
from llmcli.engine import scheduler as scheduling  # noqa: E402
from llmcli.engine.outputs import EngineStats  # noqa: E402
from llmcli.engine.sequence import Sequence  # noqa: E402
from llmcli.engine.state_pool import plan_state_pages  # noqa: E402
from llmcli.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Cost:
    """Seconds a step takes: a decode part for its decode rows, a fixed overhead when it computes prompt
    tokens (an eager step), and the prompt tokens themselves."""

    decode_s: float
    row_s: float
    eager_s: float
    token_s: float

    def step(self, rows: int, prompt_tokens: int) -> float:
        return self.decode_s + self.row_s * rows + (self.eager_s + self.token_s * prompt_tokens if prompt_tokens
                                                    else 0.0)


def simulate(prompt_lens: list[int], outputs: list[int], args: argparse.Namespace, cost: Cost,
             groups: bool) -> dict[str, float]:
    """Every request through ``Scheduler`` (each token read back at once; a request finishes at its length)."""
    config = SimpleNamespace(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, mixed_steps=True, kvcache_block_size=args.block_size,
                             enable_prefix_caching=False, hf_config=None, num_state_snapshots=None)
    pages = None
    if args.row_pages:
        kv_min = -(-args.max_model_len // args.block_size)
        pages, _ = plan_state_pages(config, args.row_pages, args.num_blocks, kv_min, shared=True)
    fraction = scheduling.GROUP_FRACTION
    scheduling.GROUP_FRACTION = fraction if groups else 1 << 62  # groups of one: each prompt starts when it can
    try:
        stats = EngineStats()
        sched = scheduling.Scheduler(config, args.num_blocks, stats, state_pages=pages)
        for i, (n, out) in enumerate(zip(prompt_lens, outputs)):
            sched.add(Sequence([1 + (7 * i + j) % 1000 for j in range(n)],
                               SamplingParams(max_tokens=out, ignore_eos=True), args.block_size))
        kinds = {"decode": 0, "mixed": 0, "prefill": 0}
        rows = seconds = 0.0
        while sched.has_unfinished():
            batch = sched.schedule()
            if batch is None:
                raise RuntimeError("the scheduler planned nothing with requests left (too few KV blocks?)")
            sched.launched(batch.seqs, batch.sampled)
            decode = batch.num_decode if batch.is_prefill else len(batch.seqs)
            kinds["mixed" if batch.is_prefill and decode else "prefill" if batch.is_prefill else "decode"] += 1
            rows += decode
            seconds += cost.step(decode, batch.num_tokens - decode)
            for seq in batch.sampled:  # the token read back: a placeholder no longer
                seq.token_ids[-1] = 3
                seq.num_pending -= 1
                seq.pending_row = -1
                if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
    finally:
        scheduling.GROUP_FRACTION = fraction
    steps = sum(kinds.values())
    return {**kinds, "steps": steps, "mean decode rows": rows / steps, "seconds": seconds,
            "max_num_seqs": config.max_num_seqs, "peak running": stats.peak_running,
            "preemptions": stats.num_preemptions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-num-seqs", type=int, default=209, help="Qwen3.6-27B's on an H200")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1 << 20, help="KV blocks (default: more than any need)")
    p.add_argument("--row-pages", type=int, default=0, help="blocks a sequence's states take (a hybrid's pool)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--decode-ms", type=float, default=25.0, help="a decode step's time whatever its rows")
    p.add_argument("--row-ms", type=float, default=18.0 / 209, help="a decode step's time per row")
    p.add_argument("--eager-ms", type=float, default=250.0, help="what a step computing prompt tokens costs more")
    p.add_argument("--token-us", type=float, default=98.0, help="per prompt token")
    p.add_argument("--smoke", action="store_true", help="a small workload (CI)")
    add_workload_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.max_num_seqs, args.max_input, args.max_output = 48, 20, 300, 200
        args.min_input, args.min_output = min(args.min_input, 300), min(args.min_output, 200)
    prompts, outputs, _ = make_workload(args, {"vocab": 1000, "eos_token_ids": []})
    cost = Cost(args.decode_ms / 1e3, args.row_ms / 1e3, args.eager_ms / 1e3, args.token_us / 1e6)
    rows = []
    for groups in (False, True):
        r = simulate([len(x) for x in prompts], outputs, args, cost, groups)
        rows.append(["in groups" if groups else "each as a slot frees", r["max_num_seqs"], r["peak running"],
                     r["preemptions"], r["steps"], r["decode"], r["mixed"], r["prefill"],
                     f"{r['mean decode rows']:.1f}", f"{r['seconds']:.2f}"])
    print(f"{len(prompts)} requests, budget {args.max_num_batched_tokens} tokens a step")
    print(md_table(["admission", "max_num_seqs", "peak running", "preemptions", "steps", "decode", "mixed",
                    "prefill", "mean decode rows", "estimated s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
