"""Rich progress on stderr while generating, and the summary table at the end."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table


def say(console: Console, text: str) -> None:
    """A plain message line: never wrapped (so file:line: field stays greppable), no markup, no emoji codes."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _human(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class _Rates:
    """Token rates over the last few seconds (a cumulative average would hide slow-downs)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, prompt_tokens: int, generated: int) -> tuple[float, float]:
        now = time.monotonic()
        self.samples.append((now, prompt_tokens, generated))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, p0, g0 = self.samples[0]
        dt = now - t0
        return ((prompt_tokens - p0) / dt, (generated - g0) / dt) if dt > 0 else (0.0, 0.0)


class GenerateProgress:
    """Live bar: requests done / total, prompt and generation tok/s, running / waiting, KV use, times.

    Disabled, it does nothing, so the runner calls it unconditionally.
    """

    def __init__(self, total: int, console: Console, enabled: bool) -> None:
        self.enabled = enabled
        self._rates = _Rates()
        self._last_refresh = 0.0
        self._progress = Progress(
            TextColumn("[bold]generate"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"),
            TextColumn("{task.fields[queue]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not enabled,
        )
        self._task = self._progress.add_task("generate", total=total, rates="", queue="")

    def __enter__(self) -> "GenerateProgress":
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._progress.stop()

    def advance(self, n: int = 1) -> None:
        if self.enabled:
            self._progress.advance(self._task, n)

    def update(self, stats: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_refresh < 0.2:  # stats are cheap, but re-rendering every step is not
            return
        self._last_refresh = now
        prompt_rate, gen_rate = self._rates.add(stats.prefill_tokens_computed, stats.generated_tokens)
        self._progress.update(
            self._task,
            rates=f"prompt {_human(prompt_rate)} tok/s · gen {_human(gen_rate)} tok/s",
            queue=f"run {stats.num_running} · wait {stats.num_waiting} · KV {stats.kv_cache_usage:.0%}",
        )


@dataclass
class GenerateSummary:
    """What one `generate` run did (this run only: records answered by an earlier run are `skipped`)."""

    total: int
    answered: int
    failed: int
    skipped: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float  # the whole command, model loading included
    generate_s: float  # from the engine being ready to the last record: what the throughputs use
    prefix_cache_hit_rate: float
    preemptions: int
    interrupted: bool


def summary_table(s: GenerateSummary) -> Table:
    gen = max(s.generate_s, 1e-9)
    rows = [
        ("requests answered", f"{s.answered} / {s.total}"),
        ("requests failed", str(s.failed)),
        ("already answered (resume)", str(s.skipped)),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("wall time (with start-up)", f"{s.wall_s:.2f} s"),
        ("generation time", f"{s.generate_s:.2f} s"),
        ("requests/s", f"{s.answered / gen:.2f}"),
        ("prompt tokens/s", f"{s.prompt_tokens / gen:,.1f}"),
        ("generated tokens/s", f"{s.generated_tokens / gen:,.1f}"),
        ("total tokens/s", f"{(s.prompt_tokens + s.generated_tokens) / gen:,.1f}"),
        ("prefix-cache hit rate", f"{s.prefix_cache_hit_rate:.1%}"),
        ("preemptions", str(s.preemptions)),
    ]
    return key_value_table("llmcli generate" + (" (interrupted)" if s.interrupted else ""), rows)


def key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column summary: bold names, right-aligned values."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table
