"""Whether a run's prompts share a prefix shorter than one KV block: the prefix cache shares whole blocks only,
so such a prefix is computed again for every prompt, and a smaller --block-size would share it."""
from __future__ import annotations

import statistics

MIN_SHARED = 16  # tokens two prompts must share for the block size to matter (the smallest block worth it)
LOW_HIT_RATE = 0.10
BLOCK_CHOICES = (128, 64, 32, 16)


class SharedPrefixes:
    """Counts, prompt by prompt, how many tokens each shares with the prompt before it (up to one block)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prompts = 0
        self.full_block = 0  # prompts sharing at least a whole block: the cache can serve them
        self.short: list[int] = []  # shared lengths from MIN_SHARED up to, not including, a block
        self._previous: list[int] = []

    def observe(self, ids: list[int]) -> None:
        previous, self._previous = self._previous, ids
        self.prompts += 1
        cap = min(self.block_size, len(ids), len(previous))
        if previous[:self.block_size] == ids[:self.block_size] and cap == self.block_size:
            self.full_block += 1
            return
        lo, hi = 0, cap  # the longest shared start, found with slice comparisons (C speed, no per-token loop)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if previous[:mid] == ids[:mid]:
                lo = mid
            else:
                hi = mid - 1
        if lo >= MIN_SHARED:
            self.short.append(lo)

    def hint(self, hit_rate: float) -> str | None:
        """A note for the summary when most prompts share a prefix shorter than a block and few tokens hit."""
        if self.prompts < 8 or len(self.short) * 2 <= self.prompts or hit_rate >= LOW_HIT_RATE:
            return None
        shared = int(statistics.median(self.short))
        fits = [b for b in BLOCK_CHOICES if b < self.block_size and shared // b * b >= 0.75 * shared]
        size = fits[0] if fits else min(BLOCK_CHOICES)
        if size >= self.block_size or shared < size:
            return None
        return (f"{len(self.short):,} of {self.prompts:,} prompts share their first ~{shared} tokens with the "
                f"prompt before them, less than one {self.block_size}-token KV block, and the prefix cache shares "
                f"whole blocks only (hit rate {hit_rate:.1%}); --block-size {size} would share "
                f"{shared // size * size} of them")
