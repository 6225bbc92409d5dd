"""Where a prefill step's linear-attention states come from and where snapshots of them go (hybrid models with
prefix caching: engine/state_snapshots.py).

A mixed step's decode rows (one token each, continuing their own row's state) are split off first
(``linear_step``): the layers run them through the decode path, in place in the pool, so that a thousand of them
cost no gather of their states; the segments below describe the chunks after them.

Each chunk of the varlen step starts from a slot of the state pool: its own row's (a continued chunk), or a
snapshot's (a prefix hit), or zeros (a fresh chunk: ``AttentionMetadata.has_initial_state``). A snapshot to
take after ``o`` tokens of a chunk cuts the chunk there: the delta rule runs over the batch in passes, pass
``p`` over every chunk's ``p``-th segment from the state the previous pass left, and the state after a cut is
copied into its snapshot slot. Built once per step on the host; every Gated DeltaNet layer reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass
class Pass:
    """One varlen call of the delta rule: a segment of some chunks (``tokens`` None: the whole step)."""

    # int64: the chunks this pass continues; None: every chunk (the first pass: each chunk's first segment), so
    # the layer runs it on the step's whole state tensor, not a gathered copy (in a mixed step of a thousand
    # rows that state is a thousand slots: gigabytes per layer on Qwen3.5-9B)
    entries: torch.Tensor | None
    tokens: torch.Tensor | None  # int64: their segments' token rows, flat
    cu_seqlens: torch.Tensor | None  # int64 [len(entries) + 1]
    snapshots: list[tuple[int, int]]  # (index in this pass's chunks, pool slot): the state after the segment


@dataclass
class StateSegments:
    source: torch.Tensor  # [chunks] int64: the pool slot each chunk's initial state is read from
    sources: list[int]  # the same, on the host
    cuts: dict[int, list[tuple[int, int]]]  # chunk -> [(token offset in the chunk, pool slot)], offsets ascending
    passes: list[Pass]


@dataclass
class LinearStep:
    """A prefill step as the linear-attention layers run it: the first ``num_decode`` entries by the decode
    path, then ``rest`` (the metadata of the chunks after them, with their ``state_segments``; None: none)."""

    num_decode: int
    rest: Any


def linear_step(meta: Any, rows: np.ndarray, scheduled: np.ndarray, reads: list[tuple[int, int]],
                writes: list[tuple[int, int, int]], device: torch.device) -> LinearStep:
    """``meta``: the step's AttentionMetadata; ``rows``/``scheduled``: the plan's; ``reads``/``writes``: its
    snapshot reads and writes with pool slots (not snapshot indices). The leading one-token entries over a
    computed prefix (``meta.num_decode``) decode, up to the first that reads or writes a snapshot (its state
    is not its row's, or must be cut out of it)."""
    touched = min([e for e, _ in reads] + [e for e, _, _ in writes], default=len(rows))
    k = min(meta.num_decode, touched)
    if k == len(rows):
        return LinearStep(k, None)
    segments = None
    if reads or writes:
        cu = np.zeros(len(rows) - k + 1, dtype=np.int64)
        np.cumsum(scheduled[k:], out=cu[1:])
        segments = state_segments(rows[k:].tolist(), cu.tolist(), [(e - k, s) for e, s in reads],
                                  [(e - k, o, s) for e, o, s in writes], device)
    if k == 0:
        return LinearStep(0, replace(meta, state_segments=segments))
    # decode rows are one token each: the chunks' token offsets move down by k
    return LinearStep(k, replace(meta, cu_seqlens_q=meta.cu_seqlens_q[k:] - k, context_lens=meta.context_lens[k:],
                                 rows=meta.rows[k:], has_initial_state=meta.has_initial_state[k:], num_decode=0,
                                 state_segments=segments))


def state_segments(rows: list[int], cu: list[int], reads: list[tuple[int, int]],
                   writes: list[tuple[int, int, int]], device: torch.device) -> StateSegments:
    """``rows``: each chunk's pool row; ``cu``: the chunks' token boundaries; ``reads``: (chunk, pool slot)
    to start from; ``writes``: (chunk, offset, pool slot) to store the state in after ``offset`` tokens."""
    sources = list(rows)
    for entry, slot in reads:
        sources[entry] = slot
    cuts: dict[int, list[tuple[int, int]]] = {}
    for entry, offset, slot in sorted(writes):
        cuts.setdefault(entry, []).append((offset, slot))
    lens = [cu[i + 1] - cu[i] for i in range(len(rows))]
    bounds = [[0, *sorted({o for o, _ in cuts.get(i, ()) if o < lens[i]}), lens[i]] for i in range(len(rows))]
    passes = []
    for p in range(max((len(b) - 1 for b in bounds), default=1)):
        entries = [i for i, b in enumerate(bounds) if len(b) - 1 > p]
        ends = {i: bounds[i][p + 1] for i in entries}
        snaps = [(j, slot) for j, i in enumerate(entries) for o, slot in cuts.get(i, ()) if o == ends[i]]
        if len(entries) == len(rows) and all(len(b) == 2 for b in bounds):
            passes.append(Pass(None, None, None, snaps))
            break
        seg = [(cu[i] + bounds[i][p], cu[i] + ends[i]) for i in entries]
        tokens = np.concatenate([np.arange(lo, hi) for lo, hi in seg])
        cu_p = np.zeros(len(seg) + 1, dtype=np.int64)
        np.cumsum([hi - lo for lo, hi in seg], out=cu_p[1:])
        every = len(entries) == len(rows)
        passes.append(Pass(None if every else _on(device, entries), _on(device, tokens), _on(device, cu_p), snaps))
    return StateSegments(_on(device, sources), sources, cuts, passes)


def _on(device: torch.device, values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)
