"""The llmcli run: engine built from config.json, warm-up, one timed ``generate``, step-timer deltas, compile counts."""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from typing import Any

from benchmarks.harness.ceilings import free_memory, sync
from benchmarks.harness.output import log, say
from benchmarks.harness.report import Report, fail, section
from benchmarks.harness.workload import NEUTRAL, check_lengths


def setting_kwargs(specs: list[str]) -> dict[str, Any]:
    """Engine settings as ``name=value`` (``name`` alone: true) or ``base`` (nothing), as LLM keyword arguments."""
    out: dict[str, Any] = {}
    for spec in specs:
        if spec != "base":
            name, eq, value = spec.partition("=")
            out[name] = _value(value) if eq else True
    return out


def _value(text: str) -> Any:
    """true/false, an int (``max_num_seqs=1024``), a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def llmcli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"load_format": "dummy", "dtype": args.dtype, "device": args.device, "seed": args.seed,
            **setting_kwargs(args.engine)}


def timer_summary(engine: Any) -> dict[str, dict[str, float]]:
    return {k: dict(v) for k, v in engine.step_timer.summary().items()}


def timer_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per-step means over the steps between two summaries (summaries hold means over all steps so far)."""
    out = {}
    for kind, row in after.items():
        prev = before.get(kind, {})
        steps = row.get("steps", 0) - prev.get("steps", 0)
        if steps <= 0:
            continue
        d: dict[str, float] = {"steps": steps, "tokens": row.get("tokens", 0) - prev.get("tokens", 0)}
        for key, value in row.items():
            if key.endswith("_ms"):
                d[key] = (value * row["steps"] - prev.get(key, 0.0) * prev.get("steps", 0)) / steps
        out[kind] = d
    return out


def compiled_so_far() -> dict[str, int | None]:
    """Kernels compiled so far: variants of llmcli's Triton kernels, and torch.compile graphs.

    A difference across the timed run means a step stopped to compile (Triton's cache layout is
    internal, hence None where it cannot be read).
    """
    out: dict[str, int | None] = {"triton_variants": None, "dynamo_graphs": None}
    with contextlib.suppress(Exception):
        import importlib

        from triton.runtime.jit import JITFunction

        modules = [importlib.import_module(f"llmcli.kernels.{name}") for name in
                   ("triton_decode", "triton_prefill", "triton_store", "triton_elementwise", "triton_sample",
                    "triton_logprobs")]
        out["triton_variants"] = sum(len(c[0]) for m in modules for fn in vars(m).values()
                                     if isinstance(fn, JITFunction) for c in fn.device_caches.values())
    with contextlib.suppress(Exception):
        from torch._dynamo.utils import counters

        out["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    return out


def llmcli_generate(llm: Any, prompts: list[list[int]], outs: list[int], temperature: float,
                    device: str) -> tuple[float, list[int]]:
    from llmcli import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=o, **NEUTRAL) for o in outs]
    wall, results = timed_generate(llm, prompts, params, device)
    return wall, [len(r.token_ids) for r in results]


def timed_generate(llm: Any, prompts: list[list[int]], params: list, device: str) -> tuple[float, list]:
    """``llm.generate`` between two device syncs: (wall seconds, its outputs)."""
    sync(device)
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t, results


def run_llmcli(args: argparse.Namespace, report: Report, facts: dict[str, Any], prompts: list[list[int]],
               outs: list[int], subset: int | None) -> None:
    from llmcli import LLM

    name = facts["name"]
    entry: dict[str, Any] = {"engine_kwargs": llmcli_kwargs(args)}
    report.data["llmcli"][name] = entry
    t = time.perf_counter()
    llm = LLM(facts["path"], **entry["engine_kwargs"])
    entry["init_s"] = time.perf_counter() - t
    try:
        engine = llm.engine
        cfg = engine.config
        entry["config"] = {k: getattr(cfg, k, None) for k in (
            "device", "dtype", "attention_backend", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size",
            "max_model_len", "enforce_eager", "enable_prefix_caching", "gpu_memory_utilization")}
        runner = engine.model_runner
        entry.update(memory_report=runner.memory_report.as_dict(), kv_blocks=runner.num_blocks,
                     cuda_graphs=runner.graphs is not None)
        log(f"llmcli {name}: ready in {entry['init_s']:.1f} s, backend {entry['config']['attention_backend']}, "
            f"{entry['kv_blocks']} KV blocks, CUDA graphs {'on' if entry['cuda_graphs'] else 'off'}")

        # warm-up: other tokens than the timed prompts, so it leaves no prefix-cache hits behind
        wrng = random.Random(args.seed + 1)
        warm_prompts = [[wrng.randrange(facts["vocab"]) for _ in range(16)] for _ in range(4)]
        entry["warmup_s"], _ = llmcli_generate(llm, warm_prompts, [4] * 4, args.temperature, args.device)

        before = timer_summary(engine)
        preempt0 = engine.stats.num_preemptions
        compiled0 = compiled_so_far()
        log(f"llmcli {name}: timing {len(prompts)} requests, {sum(outs):,} output tokens")
        wall, got = llmcli_generate(llm, prompts, outs, args.temperature, args.device)
        compiled1 = compiled_so_far()
        entry["compiled_during_timed_run"] = {
            k: None if compiled0[k] is None or compiled1[k] is None else compiled1[k] - compiled0[k]
            for k in compiled0}
        say(f"llmcli {name}: compiled during the timed run: {entry['compiled_during_timed_run']}")
        entry.update(requests=len(prompts), output_tokens=sum(got), expected_output_tokens=sum(outs), wall_s=wall,
                     output_tok_s=sum(got) / wall, prompt_tokens=sum(len(p) for p in prompts),
                     preemptions=engine.stats.num_preemptions - preempt0,
                     step_timer=timer_delta(before, timer_summary(engine)))
        bad = check_lengths(got, outs)
        entry["lengths_ok"] = not bad
        if bad:
            fail(report, f"llmcli {name} output lengths", f"{len(bad)} requests wrong: {'; '.join(bad[:5])}")
        say(f"llmcli {name}: {sum(got):,} output tokens in {wall:.2f} s = {sum(got) / wall:,.0f} tok/s "
            f"(preemptions {entry['preemptions']})")
        report.save()

        if subset:
            log(f"llmcli {name}: timing the first {subset} requests (the transformers subset)")
            swall, sgot = llmcli_generate(llm, prompts[:subset], outs[:subset], args.temperature, args.device)
            entry["subset"] = {"requests": subset, "output_tokens": sum(sgot), "wall_s": swall,
                               "output_tok_s": sum(sgot) / swall, "lengths_ok": not check_lengths(sgot, outs[:subset])}
            say(f"llmcli {name} (first {subset}): {sum(sgot):,} tokens in {swall:.2f} s = "
                f"{sum(sgot) / swall:,.0f} tok/s")
            report.save()

        if not args.skip_breakdown:
            # imported here: decode_profile uses this module's timer helpers
            from benchmarks.harness.decode_profile import decode_breakdown

            section(report, f"llmcli {name} decode step breakdown", decode_breakdown, args, report, llm, facts,
                    sum(len(p) for p in prompts) // len(prompts))
    finally:
        with contextlib.suppress(Exception):
            llm.shutdown()
        del llm
        free_memory(args.device)
