"""The offline throughput benchmark: a random-token workload, a warm-up, then timed throughput and latency."""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from llmcli.cli.io.writer import reserve_stdout
from llmcli.cli.progress import say
from llmcli.engine.engine_api import EngineAPI
from llmcli.sampling_params import SamplingParams


@dataclass
class Workload:
    """Defaults are the design reference's: 256 requests, lengths uniform in [100, 1024], seed 0, EOS ignored."""

    num_prompts: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    prefix_len: int = 0
    temperature: float = 0.6
    seed: int = 0
    warmup: int = 4
    sampling: str = "plain"  # one of SAMPLING_MODES


# Qwen3's generation_config.json: what a real checkpoint gives every request that does not override them
QWEN3_FILTERS = {"top_k": 20, "top_p": 0.95}
SAMPLING_MODES = ("plain", "qwen3-defaults", "mixed")  # mixed: every other request filtered as Qwen3's defaults


def request_params(w: Workload, index: int, max_tokens: int) -> SamplingParams:
    """Request ``index``'s sampling: every filter explicit, so the workload stays the same whatever
    generation_config.json says."""
    filters = {"top_k": -1, "top_p": 1.0}
    if w.sampling == "qwen3-defaults" or (w.sampling == "mixed" and index % 2 == 0):
        filters = QWEN3_FILTERS
    return SamplingParams(temperature=w.temperature, min_p=0.0, repetition_penalty=1.0, max_tokens=max_tokens,
                          ignore_eos=True, **filters)


def parse_length(text: str, flag: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) as a (lo, hi) pair."""
    from llmcli.cli.generate import UsageError

    try:
        lo, _, hi = str(text).partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise UsageError(f"{flag} must be N or LO:HI, got {text!r}") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise UsageError(f"{flag} needs 1 <= LO <= HI, got {text!r}")
    return pair


def make_requests(w: Workload, vocab_size: int, avoid: set[int]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) for every request; the same seed gives the same workload."""
    rng = random.Random(w.seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]

    def tokens(k: int) -> list[int]:
        return [allowed[rng.randrange(len(allowed))] for _ in range(k)]

    prefix = tokens(w.prefix_len)
    requests = []
    for _ in range(w.num_prompts):
        n_in = rng.randint(*w.input_len)
        n_out = rng.randint(*w.output_len)
        requests.append((prefix + tokens(n_in), n_out))
    return requests


def unique_prompt_tokens(requests: list[tuple[list[int], int]]) -> int:
    """Prompt tokens a perfect prefix cache computes: the distinct prefixes of all prompts (in sorted order,
    each prompt adds what it does not share with the one before)."""
    count, prev = 0, []
    for ids in sorted(ids for ids, _ in requests):
        common = 0
        for a, b in zip(ids, prev):
            if a != b:
                break
            common += 1
        count += len(ids) - common
        prev = ids
    return count


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 (linear interpolation), in the unit given."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def _drain(engine: EngineAPI) -> list[Any]:
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    return finished


def run_timed(engine: EngineAPI, requests: list[tuple[list[int], int]], w: Workload) -> tuple[list[Any], float]:
    """All requests at once, as an offline batch; returns their outputs and the wall time."""
    start = time.perf_counter()
    for i, (ids, n_out) in enumerate(requests):
        engine.add_request(ids, request_params(w, i, n_out), request_id=f"bench-{i}")
    outputs = _drain(engine)
    return outputs, time.perf_counter() - start


def metrics(outputs: list[Any], elapsed: float) -> dict[str, Any]:
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.token_ids) for o in outputs)
    ttft = [(o.first_token_time - o.arrival_time) * 1e3 for o in outputs if o.first_token_time is not None]
    tpot = [(o.finish_time - o.first_token_time) * 1e3 / (len(o.token_ids) - 1)
            for o in outputs if o.first_token_time is not None and len(o.token_ids) > 1]
    latency = [(o.finish_time - o.arrival_time) * 1e3 for o in outputs]
    return {
        "num_requests": len(outputs),
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tokens_per_s": n_in / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "latency_ms": percentiles(latency),
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"llmcli bench: {result['model']} on {result['device']} ({result['dtype']})")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, key, fmt in (("requests", "num_requests", "{:d}"), ("wall time (s)", "elapsed_s", "{:.2f}"),
                            ("requests/s", "requests_per_s", "{:.2f}"),
                            ("input tokens/s", "input_tokens_per_s", "{:,.1f}"),
                            ("output tokens/s", "output_tokens_per_s", "{:,.1f}"),
                            ("total tokens/s", "total_tokens_per_s", "{:,.1f}"),
                            ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
                            ("prompt tokens computed", "prompt_tokens_computed", "{:,d}"),
                            ("unique prompt tokens", "unique_prompt_tokens", "{:,d}"),
                            ("preemptions", "num_preemptions", "{:d}")):
        table.add_row(label, fmt.format(result[key]))
    snaps = result.get("state_snapshots") or {}
    if snaps.get("slots"):
        table.add_row("state snapshots (hybrid prefix cache)",
                      f"{snaps['slots']:,} slots, {snaps['taken']:,} taken, {snaps['hits']:,} hits")
    for label, key in (("time to first token (ms)", "ttft_ms"), ("time per output token (ms)", "tpot_ms"),
                       ("request latency (ms)", "latency_ms")):
        p = result[key]
        table.add_row(label, f"mean {p['mean']:.1f} · p50 {p['p50']:.1f} · p90 {p['p90']:.1f} · p99 {p['p99']:.1f}")
    for kind, row in result["step_timer"].items():
        phases = " · ".join(f"{name.removesuffix('_ms')} {row[name]:.2f}" for name in row
                            if name.endswith("_ms") and name != "host_ms")
        table.add_row(f"{kind} steps: {row['steps']:,d}, ms per step", phases)
    console.print(table)


def run_bench_command(engine_kwargs: dict[str, Any], w: Workload, console: Console, *, as_json: bool,
                      output: Path | None) -> int:
    from llmcli.config import Config
    from llmcli.cli.generate import UsageError
    from llmcli.cli.results import check_destination, deliver
    from llmcli.sampling_params import INT64_MAX

    check_destination(output, as_json)
    if not 0 <= w.seed <= INT64_MAX - 1:  # the warm-up uses seed + 1
        raise UsageError(f"--seed must be an integer from 0 to {INT64_MAX - 1}, got {w.seed}")
    stdout = reserve_stdout() if as_json else None  # the JSON object must be all that stdout carries
    config = Config(**engine_kwargs)
    longest = w.prefix_len + w.input_len[1] + w.output_len[1]
    if longest > config.max_model_len:
        raise UsageError(f"the longest request is {longest} tokens (prefix + input + output) but max_model_len is "
                         f"{config.max_model_len}; lower --input-len/--output-len or raise --max-model-len")
    if w.num_prompts < 1 or w.warmup < 0 or w.prefix_len < 0:
        raise UsageError("--num-prompts must be >= 1, --warmup and --prefix-len >= 0")
    if w.sampling not in SAMPLING_MODES:
        raise UsageError(f"--sampling must be one of {', '.join(SAMPLING_MODES)}, got {w.sampling!r}")
    requests = make_requests(w, config.hf_config.vocab_size, set(config.eos_token_ids))
    say(console, f"bench: {w.num_prompts} requests, {sum(len(r[0]) for r in requests):,} prompt tokens, "
                 f"{sum(r[1] for r in requests):,} output tokens")

    from llmcli.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    try:
        if w.warmup:
            # Other tokens than the timed prompts, so the warm-up leaves no prefix-cache hits behind.
            warm = Workload(num_prompts=w.warmup, input_len=(16, 16), output_len=(4, 4), temperature=1.0,
                            seed=w.seed + 1, sampling=w.sampling)
            run_timed(engine, make_requests(warm, config.hf_config.vocab_size, set(config.eos_token_ids)), warm)
        before = engine.stats
        queried, hits, preempt, computed = (before.prefix_cache_queried_tokens, before.prefix_cache_hit_tokens,
                                            before.num_preemptions, before.prefill_tokens_computed)
        taken, state_hits = before.state_snapshots_taken, before.state_snapshot_hits
        engine.step_timer.reset()
        outputs, elapsed = run_timed(engine, requests, w)
        after = engine.stats
        steps = engine.step_timer.summary()
        report = engine.model_runner.memory_report
    finally:
        engine.shutdown()
    dq = after.prefix_cache_queried_tokens - queried
    result = {
        "model": engine_kwargs["model"],
        "device": config.device,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        **metrics(outputs, elapsed),
        "prefix_cache_hit_rate": (after.prefix_cache_hit_tokens - hits) / dq if dq else 0.0,
        "num_preemptions": after.num_preemptions - preempt,
        # prompt tokens run through the model (prefix-cache hits are not; a preempted one's recompute is)
        "prompt_tokens_computed": after.prefill_tokens_computed - computed,
        "unique_prompt_tokens": unique_prompt_tokens(requests),
        # hybrid models' prefix cache (0 slots: not a hybrid model, or prefix caching off)
        "state_snapshots": {"slots": after.state_snapshot_slots, "taken": after.state_snapshots_taken - taken,
                            "hits": after.state_snapshot_hits - state_hits},
        "kv_cache": {"num_blocks": report.num_blocks, "block_size": report.block_size,
                     "cache_tokens": report.cache_tokens, "groups": getattr(report, "kv_groups", [])},
        "step_timer": steps,
        "workload": {**asdict(w), "ignore_eos": True},
        "engine": {name: getattr(config, name) for name in Config.knob_names()},
    }
    if stdout is None:
        render(result, Console(emoji=False, markup=False, highlight=False))
    return deliver(result, output, stdout, console)
