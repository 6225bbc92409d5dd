"""Paged decode attention: the split-KV path as the engine runs it, and split-count and launch candidates.

For Qwen3-0.6B (16/8/128, 28 layers) and Qwen3-8B (32/8/128, 36 layers) head shapes, bf16, block size 256
(the engine's default), every batch in 1 … 256 and context in 256 … 4096 (all rows that long): one CUDA graph
per candidate holds a loop of one decode attention call per layer, each over its own cache (as many distinct
caches as fit ~16 GB, rotated), after an L2 flush. The default runs with the split count a decode graph of the
engine uses (chosen for ``--max-model-len`` keys, since graphs are captured before any context is known) and
the default launch settings; the graph's replay time minus that of a flush-only graph is the attention time
(median of CUDA-event timed replays). Prints ms per step (all layers), GB/s of KV read and its share of a
measured copy bandwidth (read + write bytes / time of a 1 GiB device copy), and the max |diff| against a
float32 torch reference. Candidates (at batch <= 64): other split counts (from the real context, programs per
SM, tokens per split) and launch settings (BLOCK_N, warps, stages); a summary table ends the run.

With ``--spread LO-HI`` it times only batches whose contexts are drawn from LO..HI (a real decode batch's are
spread): as drawn, longest first, every row at the mean length, with the grid of before run 45 (rows, KV heads)
and the engine's (``DecodeTuning.heads_fastest``: a row's KV heads side by side), alone and with the rows
launched longest first (the engine's launch), and (``--spread-splits``) other split counts.

    python benchmarks/decode_attention_gpu.py               # on CUDA, under 2 minutes
    python benchmarks/decode_attention_gpu.py --quick       # fewer shapes and candidates
    python benchmarks/decode_attention_gpu.py --spread 100-2048 --batches 64,128 --spread-splits 2,4
    python benchmarks/decode_attention_gpu.py --device cpu  # smoke test: Triton's interpreter, float32, tiny sizes
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from llmcli.kernels.triton_decode import (  # noqa: E402
    DEFAULT_TUNING, DecodeTuning, choose_num_splits, paged_decode, scratch_numel,
)

MODELS = {"0.6B": (16, 8, 128, 28), "8B": (32, 8, 128, 36)}  # q heads, kv heads, head_dim, layers
TINY = {"tiny": (4, 2, 32, 2)}
CACHE_BUDGET = 16 << 30  # bytes of distinct KV caches per case
FLUSH_BYTES = 256 << 20  # > the H200's L2 (50 MB): written before each replay's layers


@dataclass(frozen=True)
class Candidate:
    name: str
    tuning: DecodeTuning = DEFAULT_TUNING
    split_args: dict = field(default_factory=dict, hash=False, compare=False)


DEFAULT = Candidate("default")
SPLIT_CANDIDATES = [
    Candidate("ctx", split_args={"from_ctx": True}),  # split count from the real context, not max_model_len
    Candidate("pps2", split_args={"programs_per_sm": 2}),
    Candidate("pps8", split_args={"programs_per_sm": 8}),
    Candidate("min64", split_args={"min_tokens": 64}),
    Candidate("min256", split_args={"min_tokens": 256}),
]
LAUNCH_CANDIDATES = [
    Candidate("n32", replace(DEFAULT_TUNING, block_n=32)),
    Candidate("n128s2", replace(DEFAULT_TUNING, block_n=128, num_stages=2)),
    Candidate("w8", replace(DEFAULT_TUNING, num_warps=8)),
    Candidate("s2", replace(DEFAULT_TUNING, num_stages=2)),
    Candidate("s4", replace(DEFAULT_TUNING, num_stages=4)),
]


@dataclass
class Case:
    q: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    tables: torch.Tensor
    lens: torch.Tensor
    kv_bytes: int  # KV bytes one layer's call reads


def make_case(batch: int, ctx: int, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype,
              device: torch.device, copies: int) -> Case:
    per_seq = -(-ctx // block)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, per_seq)
    caches = []
    for _ in range(copies):
        shape = (num_blocks, block, kv_heads, dim)
        caches.append((torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)))
    q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return Case(q, caches, tables, lens, batch * ctx * kv_heads * dim * 2 * dtype.itemsize)


def reference(case: Case) -> torch.Tensor:
    """Float32 softmax attention over each row's gathered context (first cache)."""
    k_cache, v_cache = case.caches[0]
    batch, heads, dim = case.q.shape
    _, block, kv_heads, _ = k_cache.shape
    ctx = int(case.lens[0])
    k = k_cache[case.tables.long()].reshape(batch, -1, kv_heads, dim)[:, :ctx].float()
    v = v_cache[case.tables.long()].reshape(batch, -1, kv_heads, dim)[:, :ctx].float()
    q = case.q.float().view(batch, kv_heads, heads // kv_heads, dim)  # query head h uses KV head h // group
    scores = torch.einsum("bkgd,bnkd->bkgn", q, k) * dim ** -0.5
    return torch.einsum("bkgn,bnkd->bkgd", scores.softmax(-1), v).reshape(batch, heads, dim)


class Runner:
    """One step's layer loop for a candidate: its own outputs and scratch, the split count fixed on the host."""

    def __init__(self, case: Case, layers: int, num_splits: int, tuning: DecodeTuning,
                 sort_rows: bool = True) -> None:
        self.case, self.layers, self.num_splits, self.tuning = case, layers, num_splits, tuning
        # the engine's launch: rows longest context first (its host computes the order with the step's inputs)
        self.order = torch.argsort(case.lens, descending=True, stable=True) \
            if sort_rows and tuning.heads_fastest else None
        batch, heads, dim = case.q.shape
        n_out, n_lse = scratch_numel(batch, heads, dim, num_splits)
        dev = case.q.device
        self.part_out = torch.empty(max(n_out, 1), dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(max(n_lse, 1), dtype=torch.float32, device=dev)
        self.outs = [torch.empty_like(case.q) for _ in range(min(layers, 2))]

    def step(self) -> None:
        c = self.case
        for layer in range(self.layers):
            k_cache, v_cache = c.caches[layer % len(c.caches)]
            paged_decode(c.q, k_cache, v_cache, c.tables, c.lens, c.q.shape[2] ** -0.5, self.num_splits,
                         self.part_out, self.part_lse, out=self.outs[min(layer, len(self.outs) - 1)],
                         tuning=self.tuning, row_order=self.order)

    def first_output(self) -> torch.Tensor:
        """Layer 0's output (over the first cache; the other layers write elsewhere)."""
        return self.outs[0]


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms of ``fn`` (a graph replay on CUDA; an eager call on the CPU)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(max(1, reps // 5)):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    for _ in range(2):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graphed(fn, device: torch.device, flush: torch.Tensor | None):
    """``fn`` after an L2 flush, captured in a CUDA graph (on CUDA); the callable that runs it."""
    def body() -> None:
        if flush is not None:
            flush.zero_()
        fn()
    if device.type != "cuda":
        return body
    body()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy, read + write bytes counted."""
    n = (1 << 30) if device.type == "cuda" else (16 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(graphed(lambda: dst.copy_(src), device, None), device, 20)
    return 2 * n / ms / 1e6


@dataclass
class Result:
    model: str
    batch: int
    ctx: int
    splits: dict[str, int]
    ms: dict[str, float]
    gbs: float  # KV GB/s of the default
    max_diff: dict[str, float]
    errors: dict[str, str]


def run_case(model: str, shape: tuple, batch: int, ctx: int, args, device, dtype, copy_gbs: float,
             flush: torch.Tensor | None, num_sms: int) -> Result:
    heads, kv_heads, dim, layers = shape
    kv_bytes = batch * ctx * kv_heads * dim * 2 * dtype.itemsize
    copies = max(1, min(layers, CACHE_BUDGET // max(kv_bytes, 1))) if device.type == "cuda" else 1
    case = make_case(batch, ctx, heads, kv_heads, dim, args.block_size, dtype, device, copies)
    reps = args.reps
    base_ms = time_ms(graphed(lambda: None, device, flush), device, reps) if flush is not None else 0.0

    candidates = [DEFAULT]
    if batch <= args.tune_max_batch and not args.quick:
        candidates += SPLIT_CANDIDATES + (LAUNCH_CANDIDATES if model == args.tune_model else [])
    splits, ms, diffs, errors = {}, {}, {}, {}
    seen: dict[tuple, str] = {}
    ref = reference(case) if not args.no_check else None
    for cand in candidates:
        split_args = dict(cand.split_args)
        # a decode graph is captured before any context is known: the engine splits for the table width
        max_len = ctx if split_args.pop("from_ctx", False) else args.max_model_len
        n = choose_num_splits(batch, kv_heads, max_len, num_sms, **split_args)
        key = (n, cand.tuning)
        splits[cand.name] = n
        if key in seen:  # same launch as an earlier candidate: same time
            ms[cand.name] = ms[seen[key]]
            continue
        seen[key] = cand.name
        try:
            runner = Runner(case, layers, n, cand.tuning)
            replay = graphed(runner.step, device, flush)
            ms[cand.name] = max(time_ms(replay, device, reps) - base_ms, 1e-6)
            if ref is not None:
                diffs[cand.name] = (runner.first_output().float() - ref).abs().max().item()
        except Exception as exc:  # a launch setting the GPU cannot take (shared memory): report, go on
            errors[cand.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            ms[cand.name] = float("nan")
    gbs = kv_bytes * layers / ms[DEFAULT.name] / 1e6
    return Result(model, batch, ctx, splits, ms, gbs, diffs, errors)


def print_row(r: Result, copy_gbs: float) -> None:
    others = {k: v for k, v in r.ms.items() if k != DEFAULT.name and v == v}
    best = min(others, key=others.get) if others else "-"
    best_txt = f"{best} x{r.splits[best]} {others[best]:.3f}" if others else "-"
    diff = r.max_diff.get(DEFAULT.name, float("nan"))
    print(f"{r.model:>5} {r.batch:>5} {r.ctx:>5} {r.splits[DEFAULT.name]:>6} {r.ms[DEFAULT.name]:>9.3f} "
          f"{r.gbs:>8.0f} {100 * r.gbs / copy_gbs:>5.0f}% {diff:>9.2e}  {best_txt}", flush=True)
    for name, err in r.errors.items():
        print(f"      {name}: {err}")


def summary(results: list[Result], copy_gbs: float) -> None:
    print("\nsummary: % of copy bandwidth, default (-> best candidate, batch <= 64)")
    for model in dict.fromkeys(r.model for r in results):
        rows = [r for r in results if r.model == model]
        ctxs = sorted({r.ctx for r in rows})
        print(f"{model:>5} batch | " + " | ".join(f"ctx {c:>5}{'':>4}" for c in ctxs))
        for batch in sorted({r.batch for r in rows}):
            cells = []
            for c in ctxs:
                r = next((x for x in rows if x.batch == batch and x.ctx == c), None)
                if r is None:
                    cells.append(f"{'':>13}")
                    continue
                pct = {k: 100 * r.gbs * r.ms[DEFAULT.name] / v / copy_gbs for k, v in r.ms.items() if v == v}
                others = {k: v for k, v in pct.items() if k != DEFAULT.name}
                best = f"->{max(others.values()):3.0f}" if others else ""
                cells.append(f"{pct.get(DEFAULT.name, float('nan')):3.0f}{best:>6}".ljust(13))
            print(f"{'':>5} {batch:>5} | " + " | ".join(cells))
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")  # noqa: E731
    names = {k for r in results for k in r.ms if k != DEFAULT.name}
    for name in sorted(names):
        rel = [r.ms[DEFAULT.name] / r.ms[name] for r in results if name in r.ms and r.ms[name] == r.ms[name]]
        if rel:
            print(f"candidate {name:>7} vs default: geo-mean speed-up {geo(rel):.3f} over {len(rel)} cases, "
                  f"worst {min(rel):.3f}, best {max(rel):.3f}")


def run_spread(model: str, shape: tuple, batch: int, lo: int, hi: int, args, device, dtype, copy_gbs: float,
               flush: torch.Tensor | None, num_sms: int) -> None:
    """Contexts spread uniformly over [lo, hi] (as a real decode batch's are) with the engine's split count, in
    three launches: the grid of before run 45 (rows, KV heads) on the rows as drawn and sorted longest first, a
    row's KV heads side by side (``heads_fastest``) on the rows as drawn, and the engine's (that, rows launched
    longest first through ``row_order``); and every row at the mean length (the same KV bytes, no spread) with the
    engine's launch. Same bits in every launch (the sorted rows' after the permutation is undone), or the row
    prints FAILED. ``--spread-splits``: other split counts, old grid and engine's launch."""
    heads, kv_heads, dim, layers = shape
    gen = torch.Generator().manual_seed(batch * 7919 + lo)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    base = make_case(batch, hi, heads, kv_heads, dim, args.block_size, dtype, device, 1)
    kv_bytes = int(lens.sum()) * kv_heads * dim * 2 * dtype.itemsize
    copies = max(1, min(layers, CACHE_BUDGET // max(batch * hi * kv_heads * dim * 2 * dtype.itemsize, 1))) \
        if device.type == "cuda" else 1
    caches = base.caches + [(torch.randn_like(base.caches[0][0]), torch.randn_like(base.caches[0][1]))
                            for _ in range(copies - 1)]
    order = torch.argsort(lens, descending=True, stable=True)
    mean = torch.full_like(lens, int(lens.float().mean().round()))
    layouts = {"as drawn": (base.q, base.tables, lens), "longest first": (base.q[order], base.tables[order], lens[order]),
               "uniform at mean": (base.q, base.tables, mean)}
    n = choose_num_splits(batch, kv_heads, args.max_model_len, num_sms)
    launches = {"old grid": (replace(DEFAULT_TUNING, heads_fastest=False), False),
                "heads side by side": (DEFAULT_TUNING, False), "engine": (DEFAULT_TUNING, True)}
    # (layout, splits, launch)
    columns = [("as drawn", n, "old grid"), ("longest first", n, "old grid"), ("as drawn", n, "heads side by side"),
               ("as drawn", n, "engine"), ("uniform at mean", n, "engine")]
    extra = [(name, k, launch) for k in args.spread_splits if k != n for launch in ("old grid", "engine")
             for name in ("as drawn", "uniform at mean")]
    base_ms = time_ms(graphed(lambda: None, device, flush), device, args.reps) if flush is not None else 0.0
    ms, outs = {}, {}
    for key in columns + extra:
        name, splits, launch = key
        q, tables, row_lens = layouts[name]
        case = Case(q.contiguous(), caches, tables.contiguous(), row_lens.to(torch.int32).to(device), kv_bytes)
        tuning, sort_rows = launches[launch]
        runner = Runner(case, layers, splits, tuning, sort_rows=sort_rows)
        ms[key] = max(time_ms(graphed(runner.step, device, flush), device, args.reps) - base_ms, 1e-6)
        outs[key] = runner.first_output().clone()
    engine = outs["as drawn", n, "engine"]
    same = torch.equal(outs["longest first", n, "old grid"][torch.argsort(order.to(device))], engine) and all(
        torch.equal(outs["as drawn", n, launch], engine) for launch in ("old grid", "heads side by side"))
    pct = {k: kv_bytes * layers / v / 1e6 / copy_gbs * 100 for k, v in ms.items()}
    cells = " ".join(f"{ms[k]:>8.3f} {pct[k]:>4.0f}%" for k in columns)
    print(f"{model:>5} {batch:>5} {lo:>5}-{hi:<5} {n:>6} {cells}  {'same bits' if same else 'FAILED: bits differ'}",
          flush=True)
    for _, k, launch in [key for key in extra if key[0] == "as drawn"]:
        err = (outs["as drawn", k, launch].float() - engine.float()).abs().max().item()
        print(f"{'':>18} {f'{k} splits, {launch}':<20}: as drawn {ms['as drawn', k, launch]:.3f} "
              f"({pct['as drawn', k, launch]:.0f}%), uniform at mean {ms['uniform at mean', k, launch]:.3f} "
              f"({pct['uniform at mean', k, launch]:.0f}%); max |diff| vs the engine's {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no candidates")
    ap.add_argument("--batches", default=None, help="comma list (default 1,4,16,32,64,128,256)")
    ap.add_argument("--ctxs", default=None, help="comma list (default 256,800,2048,4096)")
    ap.add_argument("--models", default=None, help="comma list of 0.6B,8B")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=40960,
                    help="the graphs' split count is chosen for this many keys (the engine's default for Qwen3)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tune-max-batch", type=int, default=64, help="candidates only at batches up to this")
    ap.add_argument("--tune-model", default="0.6B", help="launch-setting candidates on this model only")
    ap.add_argument("--budget", type=float, default=135.0,
                    help="seconds: no new case starts after this, so the summary prints inside the stage's timeout")
    ap.add_argument("--no-check", action="store_true", help="skip the torch reference")
    ap.add_argument("--spread", default=None,
                    help="LO-HI: only contexts spread over LO..HI per row: launch orders, and uniform rows")
    ap.add_argument("--spread-splits", default="", help="comma list: split counts also timed with --spread")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cuda":
        assert torch.cuda.is_available(), "needs CUDA (or --device cpu)"
        import triton
        dtype, models = torch.bfloat16, MODELS
        batches, ctxs = [1, 4, 16, 32, 64, 128, 256], [256, 800, 2048, 4096]
        if args.quick:
            batches, ctxs = [1, 16, 64, 256], [800, 4096]
        args.block_size = args.block_size or 256
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        print(torch.cuda.get_device_name(), f"({num_sms} SMs)", "triton", triton.__version__, "torch", torch.__version__)
    else:
        dtype, models = torch.float32, TINY
        batches, ctxs = [1, 3], [40, 300]
        args.block_size = args.block_size or 16
        args.reps, args.tune_model, num_sms, flush = 5, "tiny", 4, None  # 4 "SMs": the tiny cases split
        args.max_model_len = min(args.max_model_len, 512)
    if args.models:
        models = {k: MODELS[k] for k in args.models.split(",")}
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.ctxs:
        ctxs = [int(x) for x in args.ctxs.split(",")]
    copy_gbs = copy_bandwidth(device)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write); block size {args.block_size}; {dtype}")
    if args.spread:
        lo, hi = (int(x) for x in args.spread.split("-"))
        args.spread_splits = [int(x) for x in args.spread_splits.split(",") if x]
        print(f"\n{'model':>5} {'batch':>5} {'contexts':>11} {'splits':>6} "
              + " ".join(f"{k:>14}" for k in ("old grid", "old, sorted", "heads together", "engine", "engine, uniform"))
              + "  (ms per step, all layers; % of copy bandwidth)")
        for model, shape in models.items():
            for batch in batches:
                run_spread(model, shape, batch, lo, hi, args, device, dtype, copy_gbs, flush, num_sms)
        return
    print(f"\n{'model':>5} {'batch':>5} {'ctx':>5} {'splits':>6} {'ms':>9} "
          f"{'GB/s':>8} {'copy':>6} {'max|diff|':>9}  best candidate (splits, ms)")
    print(f"{'':>24} (ms per step: all layers' attention, after an L2 flush)")
    results = []
    t0 = time.perf_counter()
    skipped = 0
    for model, shape in models.items():
        for batch in batches:
            for ctx in ctxs:
                if time.perf_counter() - t_start > args.budget:
                    skipped += 1
                    continue
                r = run_case(model, shape, batch, ctx, args, device, dtype, copy_gbs, flush, num_sms)
                print_row(r, copy_gbs)
                results.append(r)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{len(results)} cases in {time.perf_counter() - t0:.0f} s"
          + (f"; {skipped} skipped (over --budget {args.budget:.0f} s)" if skipped else ""))
    summary(results, copy_gbs)


if __name__ == "__main__":
    main()
