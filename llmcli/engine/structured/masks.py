"""Each step's token bitmask: one int32 row of bits per sampled sequence, -1 (all allowed) when unconstrained."""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import torch

from llmcli.engine.sequence import Sequence
from llmcli.engine.structured.grammar import load_llguidance


PARALLEL_ROWS = 32  # from this many constrained rows on, llguidance's thread pool fills them


def mask_threads() -> int:
    """Threads of llguidance's pool: every core this process may use (the step loop waits during a fill).
    ``LLMCLI_MASK_THREADS`` overrides."""
    from llmcli.config import env_number

    chosen = env_number("LLMCLI_MASK_THREADS", None)
    if chosen is not None:
        return chosen
    try:
        return max(1, min(32, len(os.sched_getaffinity(0))))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, min(32, os.cpu_count() or 1))


class ConstrainedBatch:
    """Fills the rows of constrained sequences from their matchers, in Rust with the GIL released. The
    matchers must have consumed every token before this step's.

    Few rows are filled one after another: handing a handful of ~20 µs fills to a thread pool cost more than
    it saved (0.1-15 ms per step on a busy 2-core host, against 0.1-0.4 ms serially for 8 rows); many rows
    go to llguidance's pool (``LLExecutor``) in one call that writes straight into the mask.

    The mask lives in two preallocated buffers used in turn (page-locked on CUDA): a step's buffer is
    written again two steps later, when the copy that read it has long run (the loop has read back a later
    step by then). Only rows that are not constrained are set to -1; the matchers write the others whole.
    """

    def __init__(self, vocab_size: int) -> None:
        self.width = (vocab_size + 31) // 32
        self._pool: Any = None
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self.threads = mask_threads()
        # seconds of each fill (the last 100k), for the bench's percentiles: a few slow rows set a step's time
        self.fill_seconds: deque[float] = deque(maxlen=100_000)

    def fill(self, seqs: list[Sequence], pinned: bool = False) -> torch.Tensor | None:
        """The [len(seqs), width] int32 bitmask, or None when no row is constrained (nothing to apply)."""
        rows = [(seq.matcher, row) for row, seq in enumerate(seqs) if seq.matcher is not None and not seq.is_finished]
        if not rows:
            return None
        start = time.perf_counter()
        n = len(seqs)
        mask = self._buffer(n, pinned)[:n]
        if len(rows) < n:
            constrained = torch.zeros(n, dtype=torch.bool)
            constrained[[row for _, row in rows]] = True
            mask[~constrained] = -1
        row_bytes, base = self.width * 4, mask.data_ptr()
        if len(rows) < PARALLEL_ROWS:
            for matcher, row in rows:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr(rows, base, row_bytes, n)
        self.fill_seconds.append(time.perf_counter() - start)
        return mask

    def _buffer(self, n: int, pinned: bool) -> torch.Tensor:
        """This step's buffer (the other one of the previous step), grown to at least ``n`` rows."""
        self._turn ^= 1
        if not self._buffers:
            self._buffers = [torch.empty(0), torch.empty(0)]
        buf = self._buffers[self._turn]
        if buf.shape[0] < n or buf.is_pinned() != pinned:
            rows = max(n, 2 * buf.shape[0]) if buf.shape[0] < n else buf.shape[0]
            buf = self._buffers[self._turn] = torch.empty((rows, self.width), dtype=torch.int32, pin_memory=pinned)
        return buf

    def accept(self, pairs: list[tuple[Any, int]]) -> list[bool]:
        """Each matcher consumes its token (many at once on the thread pool); False where it refused."""
        if len(pairs) < PARALLEL_ROWS:
            return [matcher.consume_token(token) for matcher, token in pairs]
        return self._executor.consume_token_par(pairs)

    @property
    def _executor(self) -> Any:
        if self._pool is None:
            self._pool = load_llguidance().LLExecutor(num_threads=self.threads)
        return self._pool
