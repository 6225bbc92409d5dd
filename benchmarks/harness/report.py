"""The run's record: the guarded sections, the JSON report written after each, and the final Markdown tables."""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness.bound import bound_table
from benchmarks.harness.output import fmt_f, fmt_int, log, md_table, say, write_json


class Report:
    """Every number the run produces; written as JSON after every section."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": {}, "ceilings": {}, "workloads": {}, "llmcli": {}, "transformers": {},
                                     "bounds": {}, "decode_breakdown": {}, "sections": {}, "failures": []}

    def save(self) -> None:
        write_json(self.path, self.data)


def section(report: Report, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one section; on failure print FAILED, record it, and carry on."""
    log(f"== {name}")
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # every section must let the others run
        tb = traceback.format_exc()
        last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        say(f"FAILED: {name}: {last}")
        print(tb, file=sys.stderr, flush=True)
        report.data["failures"].append({"section": name, "error": last, "traceback": tb})
        return None
    finally:
        report.data["sections"][name] = round(time.perf_counter() - start, 3)
        report.save()


def fail(report: Report, name: str, why: str) -> None:
    say(f"FAILED: {name}: {why}")
    report.data["failures"].append({"section": name, "error": why})
    report.save()


def final_tables(report: Report) -> str:
    d = report.data
    parts = []
    rows = []
    for name, wl in d["workloads"].items():
        hf = d["transformers"].get(name, {})
        hf_rate = hf.get("output_tok_s") if hf.get("wall_s") else None
        hf_n = hf.get("requests")
        lm = d["llmcli"].get(name, {})
        bound = d["bounds"].get(name, {})

        def row(engine: str, e: dict[str, Any], bound_s: float | None, hf_rate_same: float | None) -> list[Any]:
            rate = e.get("output_tok_s")
            vs = f"{rate / hf_rate_same:.1f}x" if rate and hf_rate_same else "n/a"
            share = f"{bound_s / e['wall_s']:.1%}" if bound_s and e.get("wall_s") else "n/a"
            return [name, engine, fmt_int(e.get("requests")), fmt_int(e.get("output_tokens")), fmt_f(e.get("wall_s")),
                    fmt_f(rate, 0), vs, share]

        if lm.get("wall_s"):
            same = hf_rate if hf_n == lm.get("requests") else None
            engine = f"llmcli ({lm.get('config', {}).get('attention_backend', '?')}" \
                     f"{', CUDA graphs' if lm.get('cuda_graphs') else ''})"
            rows.append(row(engine, lm, bound.get("floor_s"), same))
            sub = lm.get("subset")
            if sub and hf_n == sub.get("requests"):
                rows.append(row(f"llmcli, first {sub['requests']}", sub,
                                d["bounds"].get(f"{name} (first {hf_n})", {}).get("floor_s"), hf_rate))
        if hf.get("wall_s"):
            bkey = name if hf_n == wl.get("requests") else f"{name} (first {hf_n})"
            label = f"transformers {hf.get('transformers')} {hf.get('attn_used')}"
            if not hf.get("complete", True):
                label += " (INCOMPLETE, lower bound)"
            rows.append(row(label, hf, d["bounds"].get(bkey, {}).get("floor_s"), hf_rate))
        if bound.get("floor_s"):
            rows.append([name, "physical bound", fmt_int(wl.get("requests")), fmt_int(wl.get("output_tokens")),
                         fmt_f(bound["floor_s"]), fmt_f(bound["floor_tok_s"], 0),
                         f"{bound['floor_tok_s'] / hf_rate:.1f}x" if hf_rate and hf_n == wl.get("requests") else "n/a",
                         "100.0%"])
    parts.append(md_table(["model", "engine", "requests", "output tokens", "wall s", "output tok/s",
                           "vs transformers", "share of bound"], rows, right={2, 3, 4, 5, 6, 7}))

    c = d["ceilings"]
    parts.append(md_table(["ceiling", "value", "how"], [
        ["copy bandwidth (read + write)", f"{fmt_f((c.get('copy_bytes_per_s') or 0) / 1e12, 3)} TB/s", "measured"],
        ["matmul rate", f"{fmt_f((c.get('matmul_flops_per_s') or 0) / 1e12, 1)} TFLOP/s",
         f"measured, {c.get('dtype')} {c.get('matmul_n')}^3"]], right={1}))

    bounds = bound_table(d["bounds"])
    if bounds:
        parts.append(bounds)

    drows = []
    for name, b in d["decode_breakdown"].items():
        st = b.get("step_timer") or {}
        drows.append([name, b.get("batch"), b.get("context"), fmt_f(b.get("total_ms")),
                      fmt_f(b.get("gpu_forward_sample_ms")), fmt_f(b.get("host_ms")),
                      fmt_f(st.get("schedule_ms")), fmt_f(st.get("prepare_ms")), fmt_f(st.get("forward_ms")),
                      fmt_f(st.get("sample_ms")), fmt_f(st.get("postprocess_ms"))])
    if drows:
        parts.append("llmcli decode step (ms): total = wall time of engine.step(); device = forward + sample launched "
                     "back to back (CUDA events); host = total - device; the rest is the engine's step timer.\n\n"
                     + md_table(["model", "batch", "context", "total", "device", "host", "schedule", "prepare",
                                 "forward", "sample", "postprocess"], drows))

    krows = []
    for name, b in d["decode_breakdown"].items():
        groups = b.get("kernel_groups") or {}
        total = sum(g["us"] for g in groups.values()) or 1.0
        for group, row in sorted(groups.items(), key=lambda kv: -kv[1]["us"]):
            krows.append([name, b.get("batch"), group, fmt_f(row["kernels"], 0), fmt_f(row["us"] / 1e3, 3),
                          f"{100 * row['us'] / total:.1f}%"])
    if krows:
        parts.append("Where the device time of that decode step goes (the same step launched eagerly under the "
                     "profiler; kernel time only, no launch gaps):\n\n"
                     + md_table(["model", "batch", "kernel group", "kernels", "ms", "share"], krows))

    trows = []
    for name, e in d["llmcli"].items():
        for kind, st in (e.get("step_timer") or {}).items():
            ms = {k[:-3]: v for k, v in st.items() if k.endswith("_ms") and k != "host_ms"}
            phases, total = ", ".join(f"{k} {v:.2f}" for k, v in ms.items()), st["steps"] * sum(ms.values()) / 1e3
            trows.append([name, kind, fmt_int(st["steps"]), fmt_int(st["tokens"]), phases, f"{total:.2f} s"])
    if trows:
        parts.append("llmcli step timer over the timed run (mean ms per step by phase; a step's launch is prepare + "
                     "forward + sample, wait is the host waiting for the previous step's tokens):\n\n"
                     + md_table(["model", "step kind", "steps", "tokens", "phases", "total"], trows))
    return "\n\n".join(parts)
