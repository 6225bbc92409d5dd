"""Progress on stderr while generating (a live bar on a terminal, a plain line every 30 s in a log), and the
summary table at the end."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text


def say(console: Console, text: str) -> None:
    """A plain message line: never wrapped (so file:line: field stays greppable), no markup, no emoji codes."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _human(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class ProgressState:
    """What one frame shows. Token progress is generated tokens plus the unused budget of finished
    completions (one that stops at EOS early is done), against the run's whole budget."""

    records_total: int
    tokens_total: int  # sum over completions of max_tokens (or what max_model_len leaves)
    records_done: int = 0
    unused_tokens: int = 0
    generated: int = 0
    prompt_done: int = 0  # prompt tokens processed (computed or served by the prefix cache)
    running: int = 0
    waiting: int = 0  # the engine's queue plus the run's requests not yet handed to it
    kv_usage: float = 0.0
    elapsed_s: float = 0.0
    finished: bool = False

    @property
    def tokens_done(self) -> int:
        return min(self.tokens_total, self.generated + self.unused_tokens)


def fraction_done(st: ProgressState) -> float:
    return st.tokens_done / st.tokens_total if st.tokens_total else (1.0 if st.finished else 0.0)


def eta_s(st: ProgressState) -> float | None:
    """Seconds left at the run's average pace so far; None before the first token."""
    fraction = fraction_done(st)
    return st.elapsed_s * (1 - fraction) / max(fraction, 1e-9) if st.tokens_done > 0 else None


def log_line(st: ProgressState) -> str:
    """One plain line for a log file: when, records written, token progress, rates, ETA (no bar, no colours)."""
    elapsed = max(st.elapsed_s, 1e-9)
    eta = eta_s(st)
    if st.finished:
        when = ("done" if st.records_done >= st.records_total else "stopped") + f" after {_clock(st.elapsed_s)}"
    else:
        when = f"elapsed {_clock(st.elapsed_s)}, eta {'-:--:--' if eta is None else _clock(eta)}"
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S')} generate: {st.records_done:,}/{st.records_total:,} records "
            f"written, {fraction_done(st):.0%} of {_human(st.tokens_total)} tokens, gen {_human(st.generated / elapsed)} "
            f"tok/s, prompt {_human(st.prompt_done / elapsed)} tok/s, {when}")


def frame(st: ProgressState) -> Table:
    """Two lines that fit 80 columns: the bar with token progress and times, then requests, rates, queues."""
    fraction, eta = fraction_done(st), eta_s(st)
    if st.finished:
        times = f"{_clock(st.elapsed_s)} " + ("done" if st.records_done >= st.records_total else "stopped")
    elif eta is not None:
        times = f"{_clock(st.elapsed_s)} eta {_clock(eta)}"
    else:
        times = f"{_clock(st.elapsed_s)} eta -:--:--"
    elapsed = max(st.elapsed_s, 1e-9)
    top = Table.grid(expand=True, padding=(0, 1))
    top.add_column(no_wrap=True)
    top.add_column(ratio=1)
    top.add_column(no_wrap=True, justify="right")
    top.add_row(Text("generate", style="bold"), ProgressBar(total=1.0, completed=fraction),
                f"{fraction:4.0%} {_human(st.tokens_done)}/{_human(st.tokens_total)} tok  {times}")
    line = (f"req {st.records_done}/{st.records_total}  prompt {_human(st.prompt_done / elapsed)} tok/s  "
            f"gen {_human(st.generated / elapsed)} tok/s  run {st.running}  wait {st.waiting}  KV {st.kv_usage:.0%}")
    grid = Table.grid()
    grid.add_row(top)
    grid.add_row(Text(line, no_wrap=True, overflow="ellipsis"))
    return grid


LOG_INTERVAL_S = 30.0  # between two plain progress lines; LLMCLI_PROGRESS_INTERVAL_S changes it (tests)


def log_interval_s() -> float:
    from llmcli.config import env_number

    return float(env_number("LLMCLI_PROGRESS_INTERVAL_S", LOG_INTERVAL_S))


class GenerateProgress:
    """Progress on stderr; rates are averages since generation started, as in the summary.

    ``live``: the two-line display, redrawn in place (stderr a terminal that nothing else writes to); otherwise a
    plain line every ``log_interval_s()`` seconds and one at the end (a log file, or a terminal that OUT's
    records also go to, where redrawing in place would overwrite them). ``written``, when given, is the count
    of records in OUT, which ``req`` shows (records finished in the engine may still wait for the writer).
    Disabled, it does nothing, so the runner calls it unconditionally.
    """

    def __init__(self, total: int, console: Console, enabled: bool, tokens_total: int = 0,
                 started: float | None = None, live: bool = True,
                 written: Callable[[], int] | None = None) -> None:
        self.enabled = enabled
        self.state = ProgressState(records_total=total, tokens_total=tokens_total)
        self.console = console
        self._started = time.perf_counter() if started is None else started
        self._written = written
        self._live = Live(console=console, get_renderable=self._render, refresh_per_second=4,
                          transient=False, redirect_stdout=False, redirect_stderr=False) if enabled and live else None
        self._lines = enabled and not live
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def _sync(self) -> None:
        if not self.state.finished:
            self.state.elapsed_s = time.perf_counter() - self._started
        if self._written is not None:
            self.state.records_done = self._written()

    def _render(self) -> Table:
        self._sync()
        return frame(self.state)

    def _tick(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._sync()
            say(self.console, log_line(self.state))

    def __enter__(self) -> "GenerateProgress":
        if self._live is not None:
            self._live.start()
        elif self._lines:
            self._ticker = threading.Thread(target=self._tick, args=(log_interval_s(),), name="llmcli-progress",
                                            daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._sync()
            say(self.console, log_line(self.state))
        if self._live is not None:
            self._live.stop()

    def advance(self, n: int = 1, unused_tokens: int = 0) -> None:
        """``n`` records handed to the writer; ``unused_tokens`` of the budget will never be generated."""
        if self._written is None:
            self.state.records_done += n
        self.state.unused_tokens += unused_tokens

    def revise_budget(self, delta: int) -> None:
        """A record prepared after the run started replaces its guessed budget with its own."""
        self.state.tokens_total = max(0, self.state.tokens_total + delta)

    def update(self, stats: Any, pending: int = 0) -> None:
        st = self.state
        st.generated = stats.generated_tokens
        # Admitted prompt tokens (what the summary counts) once they are processed, not when queued.
        st.prompt_done = min(stats.prompt_tokens, stats.prefill_tokens_computed + stats.prefix_cache_hit_tokens)
        st.running, st.waiting, st.kv_usage = stats.num_running, stats.num_waiting + pending, stats.kv_cache_usage

    def finish(self, stats: Any, pending: int = 0) -> None:
        """The last frame: the final counters, and the clock stopped."""
        self.update(stats, pending)
        if not pending and not stats.num_running and not stats.num_waiting:
            self.state.prompt_done = stats.prompt_tokens
        self._sync()
        self.state.finished = True
        if self._live is not None:
            self._live.refresh()


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
    default_limited: int = 0  # records cut at a length limit they did not set (--max-tokens or the built-in one)
    state_snapshots: tuple[int, int, int, int] = (0, 0, 0, 0)  # hybrid models' prefix cache: slots, bytes, taken, hits


def summary_table(s: GenerateSummary) -> Table:
    gen = max(s.generate_s, 1e-9)
    rows = [
        ("requests answered", f"{s.answered} / {s.total}"),
        ("requests failed", str(s.failed)),
        ("cut at a default length limit", str(s.default_limited)),
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
    if s.state_snapshots[0]:
        slots, size, taken, hits = s.state_snapshots
        rows.insert(-1, ("state snapshots (hybrid prefix cache)",
                         f"{slots:,} slots ({size / 2**30:.2f} GiB), {taken:,} taken, {hits:,} hits"))
    return key_value_table("llmcli generate" + (" (interrupted)" if s.interrupted else ""), rows)


def key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column summary: bold names, right-aligned values."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table
