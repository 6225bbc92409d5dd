"""Logprobs as vLLM hands them out (per position ``{token id: Logprob}``), built when first read.

The step loop keeps each token's logprobs as a row of its step's flat lists
(``sampling_extras.LogprobBlock``); turning a long completion
into thousands of small objects (and decoding every top-k token) costs milliseconds of
host time per request, which would stall the overlapped loop at the moment the request
finishes. ``LazyLogprobs`` defers that to the first read, and pickles as a plain list
(data-parallel replicas build it in their own process before shipping).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from itertools import islice
from typing import Any

from llmcli.engine.outputs import Logprob

Entry = tuple[float, int, list[int], list[float]]  # (logprob, rank, top ids, top logprobs)


class TokenText:
    """One token's text, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        text = self.cache.get(token)
        if text is None and self.tokenizer is not None:
            text = self.cache[token] = self.tokenizer.decode([token])
        return text


def position(token: int, entry: Entry, text: TokenText) -> dict[int, Logprob]:
    """The chosen token first, then the top k (which may include it), as vLLM orders them."""
    logprob, rank, top_ids, top_logprobs = entry
    out = {token: Logprob(logprob, rank, text(token))}
    for i, (tid, lp) in enumerate(zip(top_ids, top_logprobs)):
        if tid not in out:
            out[tid] = Logprob(lp, i + 1, text(tid))
    return out


class BlockEntries:
    """A sequence's generated-token entries, cut from its steps' ``LogprobBlock``s when iterated."""

    def __init__(self, blocks: list, rows: list[int], k: int) -> None:
        self.blocks, self.rows, self.k = blocks, rows, k

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        k = self.k
        return (block.entry(row, k) for block, row in zip(self.blocks, self.rows))


class LazyLogprobs(SequenceABC):
    """A list of positions, the first ``leading_nones`` of them ``None`` (prompt logprobs: the first prompt token
    has no context, and those before ``SamplingParams.prompt_logprobs_start`` were not asked for)."""

    def __init__(self, tokens: list[int], entries: "list[Entry] | BlockEntries", text: TokenText,
                 leading_nones: int = 0) -> None:
        self._raw: tuple | None = (tokens, entries, text, leading_nones)
        self._items: list | None = None
        self._len = len(entries) + leading_nones

    def _build(self) -> list:
        if self._items is None:
            tokens, entries, text, leading_nones = self._raw
            self._items = [None] * leading_nones + [position(t, e, text) for t, e in zip(tokens, entries)]
            self._raw = None
        return self._items

    def __getitem__(self, index):  # type: ignore[override]
        return self._build()[index]

    def chosen(self, start: int) -> list[tuple[float, int]]:
        """(logprob, rank) of each position's own token (the prompt's, or the generated one) from ``start`` on,
        ``start`` at least ``leading_nones``: what a sum of log-likelihoods reads, without a dict per position."""
        if self._items is not None:  # built: each position's own token comes first in its dict
            return [(lp.logprob, lp.rank) for lp in (next(iter(d.values())) for d in self._items[start:])]
        _, entries, _, leading_nones = self._raw
        if start < leading_nones:
            raise IndexError(f"position {start} has no logprobs (the first {leading_nones} have none)")
        return [(entry[0], entry[1]) for entry in islice(entries, start - leading_nones, None)]

    def __len__(self) -> int:
        return self._len

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceABC) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._build())

    def __reduce__(self):
        return list, (self._build(),)
