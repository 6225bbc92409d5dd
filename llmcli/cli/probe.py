"""probe-memory: the start-up memory plan as a table or JSON, and what to change when the KV pool is empty."""
from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.text import Text

from llmcli.engine.outputs import MemoryReport
from llmcli.cli.io.writer import reserve_stdout
from llmcli.cli.results import check_destination, deliver
from llmcli.cli.progress import key_value_table, say

GIB = 1 << 30


def _gib(n: float) -> str:
    if abs(n) >= GIB / 100:
        return f"{n / GIB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if abs(n) >= (1 << 20) / 10 else f"{n / 1024:.1f} KiB"


def fit_hint(r: MemoryReport, knobs: dict[str, Any]) -> str | None:
    """None when one sequence of max_model_len fits; else which knob to change, and to what."""
    blocks_per_seq = math.ceil(r.max_model_len / r.block_size) if r.block_size else 0
    if r.kv_groups and any(g["window"] is not None for g in r.kv_groups):  # a window group holds only its window
        blocks_per_seq = sum(g["blocks_per_seq"] for g in r.kv_groups)
    if r.num_blocks >= blocks_per_seq or r.kv_bytes_per_block <= 0:
        return None
    need = blocks_per_seq * r.kv_bytes_per_block
    have = r.num_blocks * r.kv_bytes_per_block
    head = ("the KV pool would be empty" if r.num_blocks == 0 else
            f"the KV pool ({r.num_blocks} blocks, {r.cache_tokens} tokens) cannot hold one sequence of "
            f"max_model_len={r.max_model_len}")
    head += f": it needs {_gib(need)} ({blocks_per_seq} blocks), has {_gib(have)}."
    fixes = []
    if knobs.get("num_kvcache_blocks") is not None:
        fixes.append(f"raise --num-kvcache-blocks to at least {blocks_per_seq}")
    elif knobs.get("kv_cache_memory_gib") is not None or r.device == "cpu":
        fixes.append(f"raise --kv-cache-memory-gib to at least {math.ceil(need / GIB * 100) / 100:.2f}")
    else:
        used = r.weights_bytes + r.activation_peak_bytes + r.cuda_graph_bytes + r.other_bytes
        util = (used + need) / r.total_bytes if r.total_bytes else math.inf
        if util <= 0.99:
            now = knobs.get("gpu_memory_utilization", r.budget_bytes / r.total_bytes if r.total_bytes else 0)
            fixes.append(f"raise --gpu-memory-utilization from {now:.2f} to at least {math.ceil(util * 100) / 100:.2f}")
        fixes.append(f"lower --max-num-batched-tokens (the activation peak is {_gib(r.activation_peak_bytes)})")
        fixes.append("raise --tensor-parallel-size to split the weights over more GPUs")
    if have >= r.kv_bytes_per_token and r.kv_bytes_per_token > 0:
        fixes.append(f"lower --max-model-len to at most {have // r.kv_bytes_per_token}")
    return head + " To fix: " + "; or ".join(fixes) + "."


def report_dict(r: MemoryReport, knobs: dict[str, Any]) -> dict[str, Any]:
    d = r.as_dict()
    d["hint"] = fit_hint(r, knobs)
    return d


def _title(r: MemoryReport) -> str:
    if r.device == "cpu":
        return f"llmcli probe-memory: CPU, {r.dtype}"
    return f"llmcli probe-memory: {r.device_name}, {r.dtype}"


def _sequences(n: float) -> str:
    # Whole sequences are what fits at once; a fraction below one still says how far from one it is.
    return f"{math.floor(n):,}" if n >= 1 else f"{n:.2f}"


def _group_rows(r: MemoryReport) -> list[tuple[str, str]]:
    """Per KV group (a model with sliding-window layers): what one sequence of max_model_len holds in it at most."""
    groups = r.kv_groups or []
    if not any(g["window"] is not None for g in groups):
        return []
    return [(f"KV group {i}: {g['kind']}, {g['layers']} layers",
             f"{g['blocks_per_seq']:,} blocks ({_gib(g['bytes_per_seq'])}) per sequence")
            for i, g in enumerate(groups)]


def _state_rows(r: MemoryReport) -> list[tuple[str, str]]:
    """A hybrid model's linear-attention states: per sequence, and what is reserved for them whatever runs."""
    pages = r.state_pages
    if pages is None:
        return []
    where = "from the pool while it runs" if pages.shared else "reserved"
    rows = [("  linear-attention states per sequence",
             f"{pages.row_pages:,} blocks ({_gib(r.state_row_bytes)}), {where}")]
    if r.num_state_snapshots:
        rows.append(("  prefix-cache state snapshots", f"{r.num_state_snapshots:,} ({_gib(r.state_snapshot_bytes)})"))
    rows.append(("  reserved for states", _gib(r.state_pool_bytes)))
    return rows


def render(r: MemoryReport, hint: str | None, console: Console) -> None:
    cpu = r.device == "cpu"
    rows = [
        ("device memory", _gib(r.total_bytes)),
        # On CPU nothing is sized from a share of memory: the budget is the KV cache's alone.
        ("KV-cache budget" if cpu else "budget for llmcli", _gib(r.budget_bytes)),
        ("weights", _gib(r.weights_bytes)),
        # The CPU allocator has no peak counter, so the warm-up measures nothing there.
        ("activation peak (warm-up)", "n/a" if cpu and r.activation_peak_bytes == 0 else
         _gib(r.activation_peak_bytes)),
        ("CUDA-graph pool", "n/a" if cpu else _gib(r.cuda_graph_bytes)),
        ("other (context, allocator)", "n/a" if cpu and r.other_bytes == 0 else _gib(r.other_bytes)),
        ("KV bytes per token", f"{r.kv_bytes_per_token:,} ({r.kv_cache_dtype or r.dtype})"),
        ("KV bytes per block", f"{r.kv_bytes_per_block:,} ({r.block_size} tokens)"),
        ("KV blocks" if r.state_pages is None else "KV and state blocks",
         f"{r.num_blocks:,} ({_gib(r.num_blocks * r.kv_bytes_per_block)})"),
        *_state_rows(r),
        *_group_rows(r),
        ("tokens the cache holds", f"{r.cache_tokens:,}"),
        (f"sequences of max_model_len={r.max_model_len:,} at once", _sequences(r.max_concurrent_full_seqs)),
    ]
    console.print(key_value_table(_title(r), rows))
    for note in r.notes:
        say(console, f"note: {note}")
    if hint:
        console.print(Text.assemble(("does not fit:", "bold red"), f" {hint}"), highlight=False, soft_wrap=True)


def run_probe_command(engine_kwargs: dict[str, Any], console: Console, *, as_json: bool) -> int:
    """Exit code 0 when the KV pool has blocks, 1 when it would be empty (the engine could not start)."""
    from llmcli.config import Config
    from llmcli.engine.kv_cache import KVCacheAllocationError, KVCacheTooSmall
    from llmcli.engine.llm_engine import LLMEngine

    check_destination(None, as_json)
    stdout = reserve_stdout() if as_json else None  # the JSON object must be all that stdout carries
    config = Config(**engine_kwargs)
    startup: dict[str, float] = {}  # seconds per start-up phase (none when start-up failed)
    try:
        engine = LLMEngine(config)
    except (KVCacheTooSmall, KVCacheAllocationError) as exc:
        # The plan is what the user came for, even (especially) when it does not fit.
        report = getattr(exc, "report", None)
        if report is None:
            if stdout is not None:
                deliver({"num_blocks": 0, "hint": str(exc)}, None, stdout, console)
            else:
                say(console, f"does not fit: {exc}")
            return 1
    else:
        try:
            report = engine.model_runner.memory_report
            startup = engine.startup_s
        finally:
            engine.shutdown()
    d = report_dict(report, engine_kwargs)
    d["startup_s"] = startup
    if stdout is not None:
        if deliver(d, None, stdout, console):
            return 1
    else:
        render(report, d["hint"], Console(emoji=False, markup=False, highlight=False))
        if d["startup_s"]:
            say(console, "start-up: " + ", ".join(f"{k} {v:.2f} s" for k, v in d["startup_s"].items()))
    return 1 if report.num_blocks == 0 else 0
