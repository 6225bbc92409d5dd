#!/usr/bin/env python
"""Issue 28 in one GPU call: speed on the path users run (Qwen3's sampling defaults, flash-attn installed,
short shared prompts), and the sort-free sampler's exactness.

1. sampler: the top-k/top-p thresholds against the sort-based reference (kept set exact, bar float32 mass
   rounding at the top-p boundary), seeded draws of every path equal (one-pass, filtered, torch), in bf16
   and fp32 logits at vocab 151,936 and batch 64; then ms per call at batch 256: sort vs sort-free.
2. per model (Qwen3-0.6B, Qwen3-8B, dummy weights): the default bench workload with sampling plain,
   qwen3-defaults (top_k 20, top_p 0.95) and mixed, on triton (bar: filtered >= 95% of plain); plain on
   flash-attn when the package is importable; what ``auto`` picks (bar: within 2% of the faster).
3. Qwen3-0.6B, KV block sizes (--blocks): the default workload, and the shared-system-prompt workload
   (--shared records of 200 shared + 120-180 own tokens, 32 out) with the prefix cache on and off: prompt
   tokens computed against the unique ones (bar: <= 1.1x).

Exits 1 on a correctness failure (sampler), prints PASS/FAIL for the speed bars.

    pip install .whl/flash_attn-*.whl; python benchmarks/real_path_gpu.py     # GPU: ~6 min (see --help)
    python benchmarks/real_path_gpu.py --smoke                              # CPU, tiny model: ~2 min
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels on CPU, before any kernel module is imported

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.workload import resolve_model, write_tiny_config  # noqa: E402
from llmcli.cli.bench import Workload, make_requests, metrics, run_timed, unique_prompt_tokens  # noqa: E402
from llmcli.config import Config  # noqa: E402
from llmcli.layers.sampler import filter_logits, sample, sample_one_pass, scale_logits  # noqa: E402

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def sampler_checks(dev: str, vocab: int, rows: int) -> None:
    from llmcli.kernels.sample_scale import inverse_temperatures
    from llmcli.kernels.triton_sample import sample_unfiltered
    from llmcli.kernels.triton_sample_filter import thresholds
    from llmcli.layers.sampler import row_keys

    print(f"\n== sampler exactness, vocab {vocab:,}, batch {rows}", flush=True)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(rows, vocab, generator=g) * 3
        logits[::4] = (logits[::4] * 2).round() / 2  # many exact ties
        logits = logits.to(dtype).to(dev)
        temps = (torch.rand(rows, generator=g) + 0.3).to(dev)
        ks = torch.tensor([20, -1, 1, 64, 65, 300, 20, -1])[torch.arange(rows) % 8].to(dev)
        ps = torch.tensor([0.95, 0.9, 1.0, 0.5, 1.0, 0.7, 1.0, 1.0])[torch.arange(rows) % 8].to(dev)
        min_ps = torch.where(torch.arange(rows) % 3 == 0, 0.05, 0.0).to(dev)
        seeds = torch.randint(0, 2**62, (rows,), generator=g).to(dev)
        steps = torch.randint(0, 5000, (rows,), generator=g).to(dev)
        scaled = scale_logits(logits, temps)
        ref = torch.isfinite(filter_logits(scaled, ks, ps))
        ours = scaled >= thresholds(logits, inverse_temperatures(temps), ks, ps)[:, None]
        bad = 0
        for r in torch.nonzero((ours != ref).any(-1)).flatten().tolist():
            # a token on the wrong side must sit at the top-p boundary within float32 rounding of p
            s = scaled[r].double()
            kth = s.sort(descending=True).values[int(ks[r]) - 1] if 0 < int(ks[r]) < vocab else -float("inf")
            e = torch.where(s >= kth, (s - s.max()).exp(), 0.0)
            e = e / e.sum()
            for t in torch.nonzero(ours[r] != ref[r]).flatten().tolist():
                above = e[s > s[t]].sum().item()
                bad += abs(above - float(ps[r])) > 1e-5
        check(bad == 0, f"{dtype}: kept sets equal the reference's ({int((ours != ref).sum())} boundary tokens)")
        one_pass = sample_unfiltered(logits, temps, min_ps, row_keys(seeds, steps))
        torch_path = sample(logits, temps, None, None, min_ps, seeds, steps, False)
        check(torch.equal(one_pass, torch_path), f"{dtype}: unfiltered one-pass == torch path, every row "
              f"({int((one_pass != torch_path).sum())} differ)")
        filtered = sample_one_pass(logits, temps, ks, ps, min_ps, seeds, steps, True)
        sorted_path = sample(logits, temps, ks, ps, min_ps, seeds, steps, True)
        check(torch.equal(filtered, sorted_path), f"{dtype}: sort-free filtered == sort-based path "
              f"({int((filtered != sorted_path).sum())} differ)")
    if dev != "cuda":
        return
    b = 256
    logits = (torch.randn(b, vocab, device=dev) * 3).to(torch.bfloat16)
    args = [logits, torch.full((b,), 0.6, device=dev), torch.full((b,), 20, device=dev),
            torch.full((b,), 0.95, device=dev), torch.zeros(b, device=dev), torch.arange(b, device=dev),
            torch.zeros(b, dtype=torch.int64, device=dev)]
    print(f"  ms per call at batch {b} (top_k 20, top_p 0.95; unfiltered for the one-pass row)")
    for name, fn in (("sort-based (torch)", lambda: sample(*args, True)),
                     ("sort-free (triton)", lambda: sample_one_pass(*args, True)),
                     ("top-p only, sort-free", lambda: sample_one_pass(*args[:2], args[2] * 0 - 1, *args[3:], True)),
                     ("one-pass, unfiltered", lambda: sample_one_pass(*args, False))):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        print(f"    {name:24s} {(time.perf_counter() - t) / 20 * 1e3:7.3f}")


def engine_for(model: Path, args: argparse.Namespace, **kw):
    from llmcli.engine.llm_engine import LLMEngine

    base = dict(model=str(model), load_format="dummy", seed=0)
    if args.smoke:
        base.update(device="cpu", dtype="float32", attention_backend="torch", num_kvcache_blocks=256)
    else:
        base.update(dtype="bfloat16", gpu_memory_utilization=0.85)
    t = time.perf_counter()
    engine = LLMEngine(Config(**{**base, **kw}))
    print(f"  [engine {kw or 'defaults'}: start-up {time.perf_counter() - t:.0f} s]", flush=True)
    return engine


def timed(engine, w: Workload) -> dict:
    cfg = engine.config
    requests = make_requests(w, cfg.hf_config.vocab_size, set(cfg.eos_token_ids))
    before = engine.stats.prefill_tokens_computed
    outputs, elapsed = run_timed(engine, requests, w)
    result = metrics(outputs, elapsed)
    result["computed"] = engine.stats.prefill_tokens_computed - before
    result["unique"] = unique_prompt_tokens(requests)
    return result


def close(engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_runs(model: Path, args: argparse.Namespace, default: Workload) -> None:
    from dataclasses import replace

    from llmcli.config import flash_attn_available

    print(f"\n== {model.name}: default workload ({default.num_prompts} requests), output tok/s", flush=True)
    backend = "torch" if args.smoke else "triton"
    engine = engine_for(model, args, attention_backend=backend)
    speeds = {}
    try:
        timed(engine, replace(default, num_prompts=4, input_len=(16, 16), output_len=(4, 4)))  # warm-up
        for mode in ("plain", "qwen3-defaults", "mixed"):
            speeds[mode] = timed(engine, replace(default, sampling=mode))["output_tokens_per_s"]
            print(f"  {backend:10s} {mode:15s} {speeds[mode]:10,.0f}  ({speeds[mode] / speeds['plain']:.1%})")
    finally:
        close(engine)
    for mode in ("qwen3-defaults", "mixed"):
        print(f"  {'PASS' if speeds[mode] >= 0.95 * speeds['plain'] else 'FAIL'} {mode} >= 95% of plain")
    if args.smoke:
        return
    auto = Config(model=str(model), load_format="dummy").attention_backend
    print(f"  auto picks: {auto}")
    if not flash_attn_available():
        print("  flash-attn: not installed (pip install .whl/flash_attn-*.whl), skipped")
        return
    engine = engine_for(model, args, attention_backend="flash-attn")
    try:
        timed(engine, replace(default, num_prompts=4, input_len=(16, 16), output_len=(4, 4)))
        flash = timed(engine, default)["output_tokens_per_s"]
    finally:
        close(engine)
    print(f"  flash-attn plain {flash:10,.0f}  ({flash / speeds['plain']:.1%} of triton)")
    got = speeds["plain"] if auto == "triton" else flash
    print(f"  {'PASS' if got >= 0.98 * max(flash, speeds['plain']) else 'FAIL'} auto ({auto}) within 2% of the faster")


def block_runs(model: Path, args: argparse.Namespace, default: Workload, shared: Workload) -> None:
    from dataclasses import replace

    print(f"\n== {model.name}: KV block size; shared prompt = {shared.num_prompts} x ({shared.prefix_len} shared + "
          f"{shared.input_len[0]}-{shared.input_len[1]} own), {shared.output_len[0]} out", flush=True)
    print(f"  {'block':>5} {'default tok/s':>14} {'shared: cache':>14} {'computed':>12} {'unique':>10} "
          f"{'ratio':>6} {'wall s':>7}")
    for block in args.blocks:
        engine = engine_for(model, args, kvcache_block_size=block, enable_prefix_caching=True)
        try:
            timed(engine, replace(default, num_prompts=4, input_len=(16, 16), output_len=(4, 4)))
            speed = timed(engine, default)["output_tokens_per_s"] if block in args.default_blocks else float("nan")
            manager = engine.scheduler.block_manager
            for cache in (True, False) if block in args.cache_off_blocks else (True,):
                manager.reset_prefix_cache()
                manager.enable_prefix_caching = cache
                r = timed(engine, shared)
                ratio = r["computed"] / r["unique"]
                print(f"  {block:>5} {speed:>14,.0f} {'on' if cache else 'off':>14} {r['computed']:>12,} "
                      f"{r['unique']:>10,} {ratio:>6.2f} {r['elapsed_s']:>7.1f}", flush=True)
                if cache:
                    print(f"  {'PASS' if ratio <= 1.1 else 'FAIL'} block {block}: computed <= 1.1 x unique")
        finally:
            close(engine)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny random model, tiny workloads")
    ap.add_argument("--models", nargs="*", default=["configs/Qwen3-0.6B", "configs/Qwen3-8B"])
    ap.add_argument("--blocks", type=int, nargs="*", default=[16, 64], help="block sizes of section 3 (256: section 2)")
    ap.add_argument("--default-blocks", type=int, nargs="*", default=[16, 64],
                    help="block sizes that also run the default workload")
    ap.add_argument("--cache-off-blocks", type=int, nargs="*", default=[16], help="block sizes run cache-off too")
    ap.add_argument("--shared", type=int, default=4000, help="records of the shared-prompt workload")
    ap.add_argument("--skip", nargs="*", default=[], choices=["sampler", "models", "blocks"])
    args = ap.parse_args()
    start = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    default = Workload(sampling="plain")
    shared = Workload(num_prompts=args.shared, prefix_len=200, input_len=(120, 180), output_len=(32, 32))
    models = [resolve_model(m) for m in args.models]
    if args.smoke:
        models = [write_tiny_config()]
        default = Workload(num_prompts=8, input_len=(8, 24), output_len=(4, 8))
        shared = Workload(num_prompts=12, prefix_len=20, input_len=(4, 8), output_len=(2, 2))
        args.blocks, args.default_blocks, args.cache_off_blocks = [16], [16], [16]
    if "sampler" not in args.skip:
        sampler_checks(dev, 151936 if dev == "cuda" else 3000, 64 if dev == "cuda" else 8)
    if "models" not in args.skip:
        for model in models:
            model_runs(model, args, default)
    if "blocks" not in args.skip:
        block_runs(models[0], args, default, shared)
    print(f"\nwall time {time.perf_counter() - start:.0f} s; correctness failures: {failures or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
