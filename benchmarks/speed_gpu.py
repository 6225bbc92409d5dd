#!/usr/bin/env python
"""The speed presets: llmcli's default workload and the prefill-heavy preset, against the physical bound.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # tests/: the greedy comparison

from benchmarks.harness.bound import physical_bound, print_bound  # noqa: E402
from benchmarks.harness.ceilings import free_memory, measure_ceilings  # noqa: E402
from benchmarks.harness.llmcli_run import compiled_so_far, setting_kwargs, timed_generate  # noqa: E402
from benchmarks.harness.output import md_table, say  # noqa: E402
from benchmarks.harness.script_args import add_device_args, settle_device  # noqa: E402
from benchmarks.harness.workload import NEUTRAL, model_facts, write_tiny_config  # noqa: E402
from greedy_compare import agreement  # noqa: E402
from llmcli.cli.bench import Workload, make_requests, parse_length, request_params  # noqa: E402
from llmcli.engine.step_timer import HOST_PHASES  # noqa: E402

PREFILL_HEAVY = REPO / "configs" / "bench-prefill-heavy.toml"
SMALL, BIG = "configs/Qwen3-0.6B", "configs/Qwen3-8B"
SAMPLINGS = ["base", "sampling=qwen3-defaults", "sampling=mixed"]
# what the retired one-question scripts measured (fp8_gpu.py, moe_gpu.py, real_path_gpu.py, families_gpu.py,
# logprobs_cost.py); a preset sets these options over the command line's
PRESETS: dict[str, dict[str, Any]] = {
    "fp8": dict(models=[SMALL, BIG], variants=["base", "kv_cache_dtype=fp8"],
                later_variants=["base", "quantization=fp8"], prefill_heavy=False),
    "moe": dict(models=["configs/Qwen3-30B-A3B"], variants=["base"]),
    "sampling": dict(models=[SMALL, BIG], variants=SAMPLINGS, later_variants=SAMPLINGS, prefill_heavy=False),
    "attention": dict(models=[SMALL, BIG], variants=["base", "attention_backend=flash-attn"],
                      later_variants=["base", "attention_backend=flash-attn"], prefill_heavy=False),
    "families": dict(models=["configs/Llama-3.1-8B", "configs/Qwen2.5-7B", BIG], variants=["base"]),
    # issue 45: the default 64-token KV blocks against the old default of 256, same call
    "blocks": dict(models=[SMALL, BIG], variants=["base", "kvcache_block_size=256"],
                   later_variants=["base", "kvcache_block_size=256"], prefill_heavy=False),
    # issue 15: what logprobs=5 costs on the default workload (bar: at most 10% of the throughput)
    "logprobs": dict(models=[SMALL], variants=["base", "logprobs=5"], prefill_heavy=False),
}
LOGPROBS_BAR = 0.9  # the logprobs variant's throughput against base's
WAIT_IDLE_MS = 0.02  # a wait this short means the tokens were there already: the device had run dry


def preset_workload(path: Path) -> Workload:
    """The [bench] table of a preset as a Workload."""
    bench = tomllib.loads(path.read_text()).get("bench", {})
    return Workload(num_prompts=int(bench.get("num-prompts", 256)),
                    input_len=parse_length(bench.get("input-len", "100:1024"), "input-len"),
                    output_len=parse_length(bench.get("output-len", "100:1024"), "output-len"),
                    temperature=float(bench.get("temperature", 0.6)), seed=int(bench.get("seed", 0)),
                    warmup=int(bench.get("warmup", 4)))


def jobs_for(model: str, args: argparse.Namespace) -> dict[str, Workload]:
    """The workloads a model runs: the default one, and the prefill-heavy preset on 0.6B."""
    jobs = {"default": Workload(), "prefill-heavy": preset_workload(PREFILL_HEAVY)}
    if args.tiny:
        jobs = {"default": Workload(num_prompts=12, input_len=(16, 64), output_len=(8, 24), temperature=0.6),
                "prefill-heavy": Workload(num_prompts=48, input_len=(40, 60), output_len=(4, 4), temperature=0.0)}
    if not (args.prefill_heavy and ("0.6B" in model or args.tiny)):
        del jobs["prefill-heavy"]
    return jobs


def variant_kwargs(variant: str) -> tuple[dict[str, Any], str, int | None]:
    """A variant's engine settings, its workload's sampling mode (``sampling=...``; plain by default) and the
    logprobs every request asks for (``logprobs=K``; none by default)."""
    kwargs = setting_kwargs(variant.split("+"))
    return kwargs, kwargs.pop("sampling", "plain"), kwargs.pop("logprobs", None)


def step_records(engine: Any) -> list[tuple[str, int, float, float, dict[str, float]]]:
    """Patch ``engine.step`` to log (kind, tokens, host s, wait s, host s per phase) of every step; returns the log."""
    timer, original, records = engine.step_timer, engine.step, []

    def step():
        seconds = dict(timer.seconds)
        tokens = dict(timer.tokens)
        out = original()
        kind = timer.kind
        phases = {p: timer.seconds[(kind, p)] - seconds.get((kind, p), 0.0) for p in HOST_PHASES}
        wait = timer.seconds[(kind, "wait")] - seconds.get((kind, "wait"), 0.0)
        records.append((kind, timer.tokens[kind] - tokens.get(kind, 0), sum(phases.values()), wait, phases))
        return out

    engine.step = step
    return records


def kv_pool_bytes(engine: Any) -> int | None:
    """The KV pool the engine sized (what the physical bound's decode steps may hold at once)."""
    report = getattr(engine.model_runner, "memory_report", None)
    return report.num_blocks * report.kv_bytes_per_block if report is not None and report.num_blocks else None


def timed_run(llm: Any, prompts: list[list[int]], outs: list[int], workload: Workload, device: str,
              records: list, logprobs: int | None = None) -> dict[str, Any]:
    params = [replace(request_params(workload, i, o), logprobs=logprobs) for i, o in enumerate(outs)]
    del records[:]
    variants_before = compiled_so_far()["triton_variants"]
    wall, results = timed_generate(llm, prompts, params, device)
    variants_after = compiled_so_far()["triton_variants"]
    got = sum(len(r.token_ids) for r in results)
    read_s = None
    if logprobs is not None:
        # The per-token {id: Logprob} dicts are built when first read (engine/logprob_outputs.py): time that
        # apart, and check the values came back, one position per token, k alternatives each.
        start = time.perf_counter()
        positions = [list(r.outputs[0].logprobs) for r in results]
        read_s = time.perf_counter() - start
        assert all(len(p) == len(r.token_ids) for p, r in zip(positions, results))
        assert all(len(x) >= logprobs for p in positions for x in p)
    decode = [r for r in records if r[0] == "decode"]
    top = max((r[1] for r in decode), default=0)
    at = 256 if any(r[1] == 256 for r in decode) else top
    host_at = [r[2] for r in decode if r[1] == at]
    phases_at = {p: 1000 * statistics.median(r[4][p] for r in decode if r[1] == at) for p in HOST_PHASES} \
        if host_at else {}
    kinds = {}
    for kind in ("prefill", "mixed", "decode"):
        mine = [r for r in records if r[0] == kind]
        if mine:
            kinds[kind] = (len(mine), sum(r[1] for r in mine) / len(mine))
    return {"wall_s": wall, "output_tokens": got, "logprobs_read_s": read_s, "expected_tokens": sum(outs), "output_tok_s": got / wall,
            "decode_steps": len(decode), "mixed_steps": sum(r[0] == "mixed" for r in records),
            "phases_ms": phases_at, "kinds": kinds,
            "new_variants": None if variants_before is None or variants_after is None
            else variants_after - variants_before,
            "host_batch": at, "host_ms": 1000 * statistics.median(host_at) if host_at else None,
            "device_idle_share": (sum(r[3] * 1000 < WAIT_IDLE_MS for r in decode) / len(decode)) if decode else None}


@dataclass
class ModelCase:
    path: Path
    facts: dict[str, Any]
    jobs: dict[str, Workload]
    workloads: dict[str, tuple[list[list[int]], list[int]]]
    probe: list[list[int]]  # short greedy requests whose tokens every engine must reproduce
    variants: list[str]
    base_tokens: list[list[int]] | None = None
    base_tok_s: dict[tuple[str, bool], float] = field(default_factory=dict)  # the first engine's, per run


def model_case(model_dir: Path, variants: list[str], args: argparse.Namespace) -> ModelCase:
    facts = model_facts(model_dir)
    jobs = jobs_for(str(model_dir), args)
    avoid = set(facts["eos_token_ids"])
    workloads = {}
    for name, workload in jobs.items():
        reqs = make_requests(workload, facts["vocab"], avoid)
        workloads[name] = ([r[0] for r in reqs], [r[1] for r in reqs])
    probe = make_requests(Workload(num_prompts=16, input_len=(20, 200), output_len=(32, 32), seed=7),
                          facts["vocab"], avoid)
    return ModelCase(model_dir, facts, jobs, workloads, [p for p, _ in probe], variants)


def run_engine(case: ModelCase, n_engine: int, args: argparse.Namespace, ceil: dict[str, float], rows: list,
               failures: list[str], deadline: float) -> None:
    from llmcli import LLM, SamplingParams

    facts, variant = case.facts, case.variants[n_engine]
    settings, sampling, logprobs = variant_kwargs(variant)
    kwargs = dict(load_format="dummy", device=args.device, seed=0, **settings)
    if args.tiny:  # small budgets, so that prompts prefill in several steps beside running decodes
        kwargs.update(kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=96)
    start = time.perf_counter()
    llm = LLM(str(case.path), **kwargs)
    engine = llm.engine
    say(f"{facts['name']} {variant}: ready in {time.perf_counter() - start:.1f} s")
    try:
        records = step_records(engine)
        for mixed in (False, True):  # also the warm-up of this engine
            engine.scheduler.mixed_steps = mixed
            engine.scheduler.reset_prefix_cache()  # both cold: the step packing alone, not prefix hits, differs
            out = llm.generate(case.probe, SamplingParams(temperature=0, max_tokens=32, logprobs=logprobs,
                                                              **NEUTRAL))
            tokens = [list(o.token_ids) for o in out]
            case.base_tokens = case.base_tokens or tokens
            agree = agreement(case.base_tokens, tokens)
            say(f"  greedy agreement with {case.variants[0]} (mixed_steps=False), mixed_steps={mixed}: {100 * agree:.2f}%")
            if n_engine == 0 and agree < 0.9:  # the same engine: only bf16 near-ties may part the tokens
                failures.append(f"{facts['name']}: mixed_steps={mixed} agrees on {100 * agree:.1f}% of greedy tokens")
        for job, workload in case.jobs.items():
            if job == "prefill-heavy" and n_engine > 0:
                continue  # ~40 s a run: the first engine only
            prompts, outs = case.workloads[job]
            for mixed in (engine.config.mixed_steps,):  # the default only; both settings' tokens compared above
                if time.perf_counter() > deadline:
                    say(f"SKIPPED {facts['name']} {variant} {job} mixed_steps={mixed}: past the time budget")
                    continue
                engine.scheduler.mixed_steps = mixed
                engine.scheduler.reset_prefix_cache()  # no run reuses an earlier run's prompts
                r = timed_run(llm, prompts, outs, replace(workload, sampling=sampling), args.device, records,
                              logprobs)
                cfg = engine.config
                bound = physical_bound(facts, prompts, outs, ceil, 2 if args.device == "cuda" else 4,
                                       max_concurrent=cfg.max_num_seqs,
                                       weight_elem_bytes=None if getattr(cfg.quant_config, "source", "mxfp4") == "mxfp4" else 1,
                                       kv_elem_bytes=1 if cfg.kv_torch_dtype.itemsize == 1 else None,
                                       kv_pool_bytes=kv_pool_bytes(engine))
                if n_engine == 0 and not mixed:
                    print_bound(f"{facts['name']} {job}", bound)
                share = bound["floor_s"] / r["wall_s"] if bound.get("floor_s") else None
                kinds = ", ".join(f"{k} {n} x {t:.0f}" for k, (n, t) in r["kinds"].items())
                say(f"  {job} mixed_steps={mixed}: {r['output_tok_s']:,.0f} tok/s in {r['wall_s']:.2f} s; steps "
                    f"(count x mean tokens): {kinds}; host phases ms at batch {r['host_batch']}: "
                    + " ".join(f"{p} {v:.3f}" for p, v in r["phases_ms"].items() if v > 0)
                    + f"; Triton variants first needed in this run: {r['new_variants']}")
                if r["logprobs_read_s"] is not None:
                    say(f"  reading every logprob back as vLLM-shaped dicts (after the run): {r['logprobs_read_s']:.2f} s")
                if r["output_tokens"] != r["expected_tokens"]:
                    failures.append(f"{job}: {r['output_tokens']} output tokens, expected {r['expected_tokens']}")
                base = case.base_tok_s.setdefault((job, mixed), r["output_tok_s"])
                if logprobs is not None:
                    ratio = r["output_tok_s"] / base
                    say(f"  logprobs={logprobs} against base: {ratio:.3f} ({(1 - ratio) * 100:.1f}% cost; bar: at most "
                        f"{(1 - LOGPROBS_BAR) * 100:.0f}%): {'PASS' if ratio >= LOGPROBS_BAR else 'FAIL'}")
                rows.append([facts["name"], job, variant, mixed, f"{r['output_tok_s']:,.0f}",
                             f"{r['output_tok_s'] / base:.2f}x", f"{r['wall_s']:.2f}",
                             "n/a" if share is None else f"{100 * share:.1f}%",
                             "n/a" if r["host_ms"] is None else f"{r['host_ms']:.3f} @{r['host_batch']}",
                             "n/a" if r["device_idle_share"] is None else f"{100 * r['device_idle_share']:.0f}%"])
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(p, device="cuda", tiny="a tiny random model and small workloads")
    p.add_argument("--models", nargs="+", default=["configs/Qwen3-0.6B", "configs/Qwen3-8B"])
    p.add_argument("--variants", nargs="+", default=["base", "sample_in_graph=false"],
                   help="engines to build for the first model (see the module docstring)")
    p.add_argument("--later-variants", nargs="+", default=["base"], help="engines to build for the other models")
    p.add_argument("--no-prefill-heavy", dest="prefill_heavy", action="store_false")
    p.add_argument("--preset", choices=sorted(PRESETS), help="models and variants of a retired script (PRESETS)")
    p.add_argument("--time-budget", type=float, default=280, help="seconds; later runs are skipped past it")
    args = p.parse_args(argv)
    for name, value in PRESETS.get(args.preset, {}).items():
        setattr(args, name, value)
    settle_device(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.time_budget
    if args.tiny:
        args.models = [str(write_tiny_config())]
        if args.device == "cpu" and not args.preset:  # no CUDA graphs on the CPU: engine variants would be the same engine
            args.variants = args.later_variants = ["base", "sampling=mixed"]
    ceil = measure_ceilings(args.device, args.tiny, fp8=any("quantization" in v for v in
                                                            args.variants + args.later_variants))
    rows: list[list[Any]] = []
    failures: list[str] = []
    cases = [model_case(Path(m), args.variants if i == 0 else args.later_variants, args)
             for i, m in enumerate(args.models)]
    # every model's first engine before any model's second: the base figures first if time runs out
    for n_engine in range(max(len(c.variants) for c in cases)):
        for case in cases:
            if n_engine >= len(case.variants):
                continue
            if time.perf_counter() > deadline:
                say(f"SKIPPED {case.facts['name']} {case.variants[n_engine]}: past the time budget")
                continue
            try:
                run_engine(case, n_engine, args, ceil, rows, failures, deadline)
            except Exception as exc:  # one broken engine must not hide the others' figures
                failures.append(f"{case.facts['name']} {case.variants[n_engine]}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
    say("\n## speed presets\n")
    say(md_table(["model", "workload", "engine", "mixed_steps", "output tok/s", "vs base", "wall s", "of bound",
                  "host ms/decode step", "decode steps device idle"], rows, right={4, 5, 6, 7, 8, 9}))
    say(f"\ndevice idle: share of decode steps whose tokens were ready (< {WAIT_IDLE_MS} ms wait) when the host came.")
    for failure in failures:
        say(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
