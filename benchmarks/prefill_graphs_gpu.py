#!/usr/bin/env python
"""Prefill graphs (``prefill_graphs=True``) on and off in one engine: greedy agreement, then a prefill-heavy job.

One Qwen3-0.6B engine (dummy weights) built with the prefill graphs; they are switched off for a run by
setting the runner's ``prefill_graphs`` to None and back. First 16 prompts of 20-600 tokens, 32 greedy tokens
each, both ways (agreement by position: the graphs pad a step's GEMMs to a bucket, so cuBLAS may pick other
kernels and round differently; near-ties of random weights then flip a token now and then). Then N prompts
shaped like the prefill-heavy preset (540-600 tokens, 32 out), off, on, off, on: wall time, and the step
timer's forward (launch) ms per mixed or prefill step.

    python benchmarks/prefill_graphs_gpu.py --prompts 6000     # GPU: ~1.5 minutes
    python benchmarks/prefill_graphs_gpu.py --device cpu --tiny  # smoke test (no graphs on the CPU)
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.output import say  # noqa: E402
from benchmarks.harness.workload import model_facts  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/Qwen3-0.6B")
    p.add_argument("--prompts", type=int, default=6000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a few short prompts")
    args = p.parse_args(argv)
    from llmcli import LLM, SamplingParams

    model = REPO / args.model
    facts = model_facts(model)
    rng = random.Random(17)
    vocab = facts["vocab"]
    neutral = dict(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, ignore_eos=True)
    t = time.perf_counter()
    kwargs = dict(max_model_len=1024, num_kvcache_blocks=64) if args.tiny else {}
    llm = LLM(str(model), load_format="dummy", seed=0, device=args.device, prefill_graphs=True, **kwargs)
    runner = llm.engine.model_runner
    graphs = runner.prefill_graphs
    what = "none (CPU)" if graphs is None else \
        f"{len(graphs.buckets)} buckets {graphs.buckets}, pool {graphs.pool_bytes / 2**30:.2f} GiB"
    say(f"{facts['name']}: ready in {time.perf_counter() - t:.1f} s; start-up phases {runner.startup_s}; prefill "
        f"graphs: {what}")

    probe = [[rng.randrange(vocab) for _ in range(rng.randint(20, 600))] for _ in range(4 if args.tiny else 16)]
    tokens = {}
    for on in (False, True):
        runner.prefill_graphs = graphs if on else None
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        out = llm.generate(probe, SamplingParams(temperature=0, max_tokens=32, **neutral))
        tokens[on] = [list(o.token_ids) for o in out]
    same = sum(a == b for x, y in zip(tokens[False], tokens[True]) for a, b in zip(x, y))
    total = sum(len(x) for x in tokens[False])
    first = sum(x[0] == y[0] for x, y in zip(tokens[False], tokens[True]))
    say(f"greedy agreement, graphs on vs off: {100 * same / total:.2f}% of positions, first token "
        f"{first}/{len(probe)} prompts")

    n = 8 if args.tiny else args.prompts
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(540, 600) // (20 if args.tiny else 1))]
               for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=4 if args.tiny else 32, **neutral)
    say(f"\n{n} preset-shaped prompts ({sum(map(len, prompts)):,} prompt tokens), mixed steps "
        f"{llm.engine.scheduler.mixed_steps}, max_num_seqs {llm.engine.config.max_num_seqs}")
    say("| graphs | round | wall s | eager-shaped steps | forward ms/step | prepare | schedule | postprocess | wait |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for on in (False, True):
            runner.prefill_graphs = graphs if on else None
            llm.engine.scheduler.block_manager.reset_prefix_cache()
            timer = llm.engine.step_timer
            timer.reset()
            sync(args.device)
            t = time.perf_counter()
            llm.generate(prompts, params)
            sync(args.device)
            wall = time.perf_counter() - t
            summary = timer.summary()
            kind = "mixed" if "mixed" in summary else "prefill"
            row = summary.get(kind, {})
            say(f"| {'on' if on else 'off'} | {r + 1} | {wall:.2f} | {kind} {row.get('steps', 0):.0f} | "
                + " | ".join(f"{row.get(f'{p}_ms', 0.0):.2f}" for p in ("forward", "prepare", "schedule",
                                                                         "postprocess", "wait")) + " |")
    runner.prefill_graphs = graphs
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
