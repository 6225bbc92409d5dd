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

``Chunks`` carries what each layer needs of the chunks on the host (boundaries, rows, which start fresh) and
on the device (fla's chunk indices), built and uploaded here once a step: a layer that read a device value back
(``tolist``, a boolean mask, a tensor made from a list) would wait for the device there, every layer, and the
host could no longer run ahead of it (a small mixed step of Qwen3.5-9B took 270 ms against 10 ms a decode
step, 2026-12-04 call P6 in benchmarks/RESULTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

# the runner's ``engine/uploader.Uploader`` (layers import nothing from the engine): ``upload(dtype, *parts)``
# packs host lists into one copy and returns a device tensor per part
Uploader = Any
# fla-core's chunk length in chunk_gated_delta_rule (its default, which kernels/gated_delta_fla.py keeps)
FLA_CHUNK = 64


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
    chunk_indices: torch.Tensor | None = None  # int64 [blocks, 2]: fla's (chunk, block) pairs of these segments


@dataclass
class StateSegments:
    source: torch.Tensor  # [chunks] int64: the pool slot each chunk's initial state is read from
    sources: list[int]  # the same, on the host
    cuts: dict[int, list[tuple[int, int]]]  # chunk -> [(token offset in the chunk, pool slot)], offsets ascending
    passes: list[Pass]


@dataclass
class Chunks:
    """A varlen step's chunks as the Gated DeltaNet layers read them (``AttentionMetadata.chunks``)."""

    cu: list[int]  # token boundaries
    rows: list[int]  # each chunk's pool row
    fresh: list[bool]  # starts from zeros (no computed prefix)
    carried: torch.Tensor  # bool [chunks]: not fresh
    cu_seqlens: torch.Tensor  # int64 [chunks + 1]
    chunk_indices: torch.Tensor  # int64 [blocks, 2]: fla's (chunk, block of FLA_CHUNK tokens) pairs
    # chunks that start from a snapshot (a prefix hit): their pool rows and the snapshots' slots
    moved: tuple[torch.Tensor, torch.Tensor] | None = None


def chunk_indices(cu: list[int] | np.ndarray) -> np.ndarray:
    """fla's chunk indices for chunks with boundaries ``cu``: (chunk, block) for every FLA_CHUNK-token block of
    every chunk, flat (what fla computes from a device ``cu_seqlens`` with a host sync when not given them)."""
    lens = np.diff(np.asarray(cu, dtype=np.int64))
    counts = -(-lens // FLA_CHUNK)
    chunk = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    block = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([chunk, block], 1).reshape(-1)


def make_chunks(rows: list[int], cu: list[int], fresh: list[bool], sources: list[int] | None,
                uploader: Uploader) -> Chunks:
    """``Chunks`` of a step (``sources``: each chunk's initial-state slot where prefix hits change it)."""
    moved = [i for i, row in enumerate(rows) if not fresh[i] and sources is not None and sources[i] != row]
    carried_t, cu_t, idx_t, into_t, from_t = uploader.upload(
        torch.int64, [not f for f in fresh], cu, chunk_indices(cu), [rows[i] for i in moved],
        [sources[i] for i in moved] if moved else [])
    return Chunks(cu, rows, fresh, carried_t != 0, cu_t, idx_t.view(-1, 2), (into_t, from_t) if moved else None)


class DirectUpload:
    """``Uploader``'s interface, copying at once: for metadata built outside a step (the warm-up, tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, dtype: torch.dtype, *parts) -> list[torch.Tensor]:
        return [torch.as_tensor(np.asarray(p), dtype=dtype).to(self.device) for p in parts]


def chunks_of(meta: Any, pooled: bool) -> Chunks:
    """``meta.chunks``, or built from the metadata's device values where it was made by hand (the warm-up,
    tests; each value read back waits for the device). ``pooled``: the layer keeps states (else all fresh)."""
    if meta.chunks is not None:
        return meta.chunks
    cu, rows = meta.cu_seqlens_q.tolist(), meta.rows.tolist()
    if not pooled:
        fresh = [True] * len(rows)
    elif meta.has_initial_state is not None:
        fresh = [not cached for cached in meta.has_initial_state.tolist()]
    else:  # the computed prefix is what the keys add
        lens = meta.context_lens.tolist()
        fresh = [lens[i] == cu[i + 1] - cu[i] for i in range(len(rows))]
    segments = meta.state_segments if pooled else None
    return make_chunks(rows, cu, fresh, segments.sources if segments is not None else None,
                       DirectUpload(meta.cu_seqlens_q.device))


@dataclass
class LinearStep:
    """A prefill step as the linear-attention layers run it: the first ``num_decode`` entries by the decode
    path, then ``rest`` (the metadata of the chunks after them, with their ``state_segments``; None: none)."""

    num_decode: int
    rest: Any


def linear_step(meta: Any, rows: np.ndarray, computed: np.ndarray, scheduled: np.ndarray,
                reads: list[tuple[int, int]], writes: list[tuple[int, int, int]], uploader: Uploader) -> LinearStep:
    """``meta``: the step's AttentionMetadata; ``rows``/``computed``/``scheduled``: the plan's;
    ``reads``/``writes``: its snapshot reads and writes with pool slots (not snapshot indices). The leading
    one-token entries over a computed prefix (``meta.num_decode``) decode, up to the first that reads or writes
    a snapshot (its state is not its row's, or must be cut out of it)."""
    touched = min([e for e, _ in reads] + [e for e, _, _ in writes], default=len(rows))
    k = min(meta.num_decode, touched)
    if k == len(rows):
        return LinearStep(k, None)
    cu = np.zeros(len(rows) - k + 1, dtype=np.int64)
    np.cumsum(scheduled[k:], out=cu[1:])
    rest_rows, cu_list = rows[k:].tolist(), cu.tolist()
    segments = None
    if reads or writes:
        segments = state_segments(rest_rows, cu_list, [(e - k, s) for e, s in reads],
                                  [(e - k, o, s) for e, o, s in writes], uploader)
    chunks = make_chunks(rest_rows, cu_list, (computed[k:] == 0).tolist(),
                         segments.sources if segments is not None else None, uploader)
    if k == 0:
        return LinearStep(0, replace(meta, state_segments=segments, chunks=chunks))
    # decode rows are one token each: the chunks' token offsets move down by k
    return LinearStep(k, replace(meta, cu_seqlens_q=meta.cu_seqlens_q[k:] - k, context_lens=meta.context_lens[k:],
                                 rows=meta.rows[k:], has_initial_state=meta.has_initial_state[k:], num_decode=0,
                                 state_segments=segments, chunks=chunks))


def state_segments(rows: list[int], cu: list[int], reads: list[tuple[int, int]],
                   writes: list[tuple[int, int, int]], uploader: Uploader) -> StateSegments:
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
        entries_t, tokens_t, cu_t, idx_t = uploader.upload(torch.int64, [] if every else entries, tokens, cu_p,
                                                           chunk_indices(cu_p))
        passes.append(Pass(None if every else entries_t, tokens_t, cu_t, snaps, idx_t.view(-1, 2)))
    return StateSegments(uploader.upload(torch.int64, sources)[0], sources, cuts, passes)
