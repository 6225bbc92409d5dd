#!/usr/bin/env python
"""The host side of one constrained decode step on this CPU: filling the token bitmasks of a batch and
advancing its matchers, as the engine does it (``StructuredRequests.fill`` / ``accept``).

A batch of matchers under structured_bench.py's schema (an array of 1000+ objects) with the full-size
151,646-id tokenizer walks forward for a number of steps, each token drawn uniformly among the tokens its
mask allows (like a model with random weights). Reported per step: fill and accept milliseconds (median,
mean), the thread count of llguidance's pool, and the fill's cost per row and core (fill ms x threads /
rows), which carries over to a host with more cores as long as no single slow row dominates.

    python benchmarks/structured_step_cpu.py [--batch 256] [--steps 60] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=None, help="llguidance pool threads (LLMCLI_MASK_THREADS)")
    p.add_argument("--shards", type=int, default=None,
                   help="independent templates of the schema (default: the compiler's, 2 x threads); 1 = the "
                        "old behaviour, every matcher a copy of one template sharing its lexer lock")
    p.add_argument("--tiny", action="store_true", help="the tiny test tokenizer instead (a quick smoke run)")
    args = p.parse_args()
    if args.threads:
        os.environ["LLMCLI_MASK_THREADS"] = str(args.threads)
    import numpy as np

    from llmcli import SamplingParams, StructuredOutputsParams
    from llmcli.engine.sequence import Sequence
    from llmcli.engine.structured import masks
    from llmcli.engine.structured.requests import StructuredRequests
    from structured_bench import schema

    if args.tiny:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(REPO / "examples" / "tiny-qwen3"))
    else:
        from full_size_tokenizer import build

        tok = build()
    vocab = len(tok)
    eos = tok.eos_token_id if tok.eos_token_id is not None else vocab - 3
    structured = StructuredRequests(tok, [eos], vocab)
    if args.shards:
        structured.compiler.shards = args.shards
    params = SamplingParams(max_tokens=1 << 20, structured_outputs=StructuredOutputsParams(json=schema(0)))
    seqs = [Sequence([1, 2, 3], params, 16, i, i) for i in range(args.batch)]
    for seq in seqs:
        structured.add(seq)
    ready: list = []
    while len(ready) < len(seqs):
        ready += structured.ready(block=True)
    rng = np.random.default_rng(0)
    fills, accepts, aborts = [], [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        mask = structured.fill(seqs, pinned=False)
        fills.append(time.perf_counter() - start)
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = [int(rng.choice(np.flatnonzero(row))) if row.any() else eos for row in bits]
        start = time.perf_counter()
        ends = structured.accept(seqs, tokens)
        accepts.append(time.perf_counter() - start)
        for seq in seqs:
            if ends.get(seq.seq_id) == "abort":
                aborts += 1
                seq.matcher = None
    structured.shutdown()
    pool = structured.masks._pool
    # llguidance's own default (before llmcli chose): 80% of the cores
    default = getattr(masks, "mask_threads", lambda: max(1, int(0.8 * (os.cpu_count() or 1))))
    threads = 1 if pool is None else default()
    fill_ms, accept_ms = statistics.median(fills) * 1e3, statistics.median(accepts) * 1e3
    fills.sort()
    fill_ms = statistics.median(fills) * 1e3
    shards = structured.compiler.templates(params.structured_outputs)
    print(f"| rows | steps | threads | templates | fill ms p50 / p90 / max / mean | accept ms p50 / mean | "
          f"fill µs per row and core (p50) |\n|---|---|---|---|---|---|---|\n| {args.batch} | {args.steps} | {threads} | {shards} | "
          f"{fill_ms:.2f} / {fills[int(len(fills) * 0.9)] * 1e3:.2f} / {fills[-1] * 1e3:.2f} / "
          f"{statistics.mean(fills) * 1e3:.2f} | {statistics.median(accepts) * 1e3:.2f} / "
          f"{statistics.mean(accepts) * 1e3:.2f} | {fill_ms * 1e3 * threads / args.batch:.1f} |"
          + (f"\naborted matchers: {aborts}" if aborts else ""))

if __name__ == "__main__":
    main()
