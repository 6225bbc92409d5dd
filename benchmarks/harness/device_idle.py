"""Where the device sits idle in a profiled window: busy time, idle gaps by size and by the kernels around them.

Input is the profiler's trace (``torch.profiler`` exported as Chrome JSON): its device records (kernels, copies,
fills) and its host records of the CUDA runtime. Kernels replayed from CUDA graphs are device records like any
other, so a gap inside a graph (one kernel's end to the next one's start) is seen as well as a gap between steps.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# what the host calls when it waits for the device
WAIT_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cuEventSynchronize",
              "cuStreamSynchronize")
GAP_BUCKETS_US = (1.0, 3.0, 10.0, 50.0)  # upper edges; a last bucket holds the rest
KERNEL_GROUPS = (  # (group, substrings of the CUDA kernel name), first match wins
    ("attention", ("_decode_partition_kernel", "_decode_reduce_kernel", "_prefill_kernel", "flash")),
    ("kv store", ("_store_kv_kernel",)),  # the triton backend's store is inside _qk_norm_rotary_kernel now
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "cublas", "splitK")),
    ("elementwise (Triton kernels)", ("_rms_norm_kernel", "_silu_and_mul_kernel", "_qk_norm_rotary_kernel")),
    ("fused elementwise (torch.compile)", ("triton_",)),
    ("copies and fills", ("Memcpy", "Memset")),
)


@dataclass(frozen=True)
class Span:
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def trace_spans(trace: dict[str, Any]) -> tuple[list[Span], list[Span]]:
    """(device records, host waits on the device) of a Chrome trace dict, each sorted by start."""
    device, waits = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = Span(str(e.get("name", "")), float(e["ts"]), float(e["dur"]))
        if e.get("cat") in DEVICE_CATEGORIES:
            device.append(span)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and span.name in WAIT_CALLS:
            waits.append(span)
    return sorted(device, key=lambda s: s.start_us), sorted(waits, key=lambda s: s.start_us)


def kernel_group(name: str) -> str:
    """The group of ``KERNEL_GROUPS`` a device record's name falls in ("other" if none)."""
    return next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")


def group_times(device: Iterable[Span], steps: int) -> dict[str, dict[str, float]]:
    """Per step, each kernel group's records and device time (records on two streams at once both count)."""
    groups: dict[str, dict[str, float]] = {}
    for s in device:
        row = groups.setdefault(kernel_group(s.name), {"records": 0.0, "us": 0.0})
        row["records"] += 1 / steps
        row["us"] += s.dur_us / steps
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["us"]))


def short(name: str, width: int = 48) -> str:
    """A kernel's name without its template arguments, cut to ``width``."""
    base = name.split("<", 1)[0].split("(", 1)[0].strip() or name
    return base if len(base) <= width else base[:width - 1] + "…"


def idle_report(device: Iterable[Span], steps: int, waits: Iterable[Span] = (), top: int = 8) -> dict[str, Any]:
    """Busy and idle time per step over the window the device records span, the gaps by size, and the
    ``top`` (kernel before, kernel after) pairs by idle time. Overlapping records (two streams) count once."""
    spans = sorted(device, key=lambda s: s.start_us)
    if not spans or steps <= 0:
        return {"device_records": 0}
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_last = spans[0].start_us, spans[0].end_us, spans[0]
    for s in spans[1:]:
        if s.start_us > cur_end:
            busy += cur_end - cur_start
            gaps.append((s.start_us - cur_end, cur_last.name, s.name))
            cur_start, cur_end, cur_last = s.start_us, s.end_us, s
        elif s.end_us >= cur_end:
            cur_end, cur_last = s.end_us, s
    busy += cur_end - cur_start
    window = cur_end - spans[0].start_us
    buckets = []
    lo = 0.0
    for hi in (*GAP_BUCKETS_US, float("inf")):
        inside = [g for g, _, _ in gaps if lo <= g < hi]
        buckets.append({"from_us": lo, "to_us": hi, "gaps_per_step": len(inside) / steps,
                        "idle_us_per_step": sum(inside) / steps})
        lo = hi
    pairs: dict[tuple[str, str], list[float]] = {}
    for g, before, after in gaps:
        pairs.setdefault((short(before), short(after)), []).append(g)
    worst = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    wait_us = sum(w.dur_us for w in waits if spans[0].start_us <= w.start_us <= cur_end)
    return {
        "device_records": len(spans), "steps": steps, "records_per_step": len(spans) / steps,
        "window_us_per_step": window / steps, "busy_us_per_step": busy / steps,
        "idle_us_per_step": (window - busy) / steps, "idle_share": (window - busy) / window if window else 0.0,
        "gaps_per_step": len(gaps) / steps, "gap_buckets": buckets,
        "host_wait_us_per_step": wait_us / steps, "groups": group_times(spans, steps),
        "worst_pairs": [{"before": b, "after": a, "gaps_per_step": len(v) / steps, "idle_us_per_step": sum(v) / steps,
                         "mean_gap_us": sum(v) / len(v)} for (b, a), v in worst],
    }


def load_trace(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
