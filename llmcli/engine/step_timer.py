"""Where a step's wall time goes: cumulative seconds per phase, split by prefill and decode."""
from __future__ import annotations

import time
from collections import defaultdict

HOST_PHASES = ("schedule", "prepare", "forward", "mask", "sample", "postprocess")


class StepTimer:
    """Phases: schedule, prepare (inputs to tensors), forward (model launch), mask (structured outputs: token
    bitmasks filled on the host), sample (sampler launch and the token read-back copy), wait (for the previous
    step's tokens), postprocess. With the overlapped loop
    the launches return at once unless something on the host blocks."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.kind = "decode"

    def phase(self, name: str) -> "_Phase":
        """``with timer.phase(name):`` adds the block's seconds to ``name`` of the current step kind."""
        return _Phase(self, name)

    def reset(self) -> None:
        """Forget what was measured so far (a warm-up, say)."""
        self.seconds.clear()
        self.steps.clear()
        self.tokens.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per step kind: total steps and tokens, and mean milliseconds per step of each phase."""
        out: dict[str, dict[str, float]] = {}
        for kind, steps in self.steps.items():
            row: dict[str, float] = {"steps": steps, "tokens": self.tokens[kind]}
            for (k, name), secs in self.seconds.items():
                if k == kind:
                    row[f"{name}_ms"] = 1000 * secs / steps
            row["host_ms"] = sum(row.get(f"{p}_ms", 0.0) for p in HOST_PHASES)
            out[kind] = row
        return out


class _Phase:
    """The context manager of ``StepTimer.phase``: a plain class, as it runs several times a step (a generator-based
    one costs a few microseconds more each)."""

    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        timer = self.timer
        timer.seconds[(timer.kind, self.name)] += time.perf_counter() - self.start
