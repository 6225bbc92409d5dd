"""Each step's token bitmask: one int32 row of bits per sampled sequence, -1 (all allowed) when unconstrained."""
from __future__ import annotations

from typing import Any

import numpy as np

from llmcli.engine.sequence import Sequence
from llmcli.engine.structured.grammar import load_llguidance


class ConstrainedBatch:
    """Fills the rows of constrained sequences from their matchers, all rows in one call on llguidance's
    thread pool (it releases the GIL). The matchers must have consumed every token before this step's."""

    def __init__(self, vocab_size: int) -> None:
        self.width = (vocab_size + 31) // 32
        self._executor: Any = None

    def fill(self, seqs: list[Sequence]) -> np.ndarray | None:
        """The [len(seqs), width] bitmask, or None when no row is constrained (nothing to apply)."""
        rows = [(seq.matcher, row) for row, seq in enumerate(seqs) if seq.matcher is not None and not seq.is_finished]
        if not rows:
            return None
        mask = np.full((len(seqs), self.width), -1, dtype=np.int32)
        if self._executor is None:
            self._executor = load_llguidance().LLExecutor()
        self._executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, self.width * 4, len(seqs))
        return mask
