"""Turning one scheduled step into flat tensors: token ids, positions, attention metadata, sampling rows.

Everything a step sends to the device goes through one ``Uploader`` call per
dtype: the host values are packed into a reused pinned buffer and cross to the
device in a single copy, then split into views. A decode step at batch 256
thus costs three small transfers instead of a dozen.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from llmcli.engine.block_tables import BlockTables, scratch_tables, table_rows
from llmcli.engine.sequence import Sequence
from llmcli.engine.uploader import Uploader
from llmcli.kernels.backend import AttentionMetadata

@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to compute logits for (None: every row)
    sampled_seqs: list[Sequence]  # the sequences that get a new token this step, in row order
    pending_rows: torch.Tensor | None = None  # decode: row of each input token in the last launch's samples, or -1


def _tables_for(seqs: list, uploader: Uploader, tables: BlockTables | None) -> tuple[BlockTables, np.ndarray]:
    if tables is None:
        return scratch_tables(seqs, uploader.device, uploader)
    rows = table_rows(seqs)
    tables.sync(seqs, rows, uploader)
    return tables, rows


def prepare_prefill(seqs: list[Sequence], uploader: Uploader, tables: BlockTables | None = None) -> StepInputs:
    """A varlen batch of chunks: prompt chunks, and (in a mixed step) decode rows as chunks of one token.

    A chunk whose last token is still in flight on the device (a decoding sequence in the overlapped loop)
    takes it from the previous launch's sampled tokens through ``pending_rows``.
    """
    n = len(seqs)
    tables, rows = _tables_for(seqs, uploader, tables)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
    counts = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, n)
    totals = np.fromiter((s.num_tokens for s in seqs), np.int64, n)
    pending = np.fromiter((s.pending_row for s in seqs), np.int64, n)
    ends = starts + counts
    cu_q = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=cu_q[1:])
    cu_k = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ends, out=cu_k[1:])
    owner = np.repeat(np.arange(n), counts)  # which chunk each token belongs to
    positions = np.arange(int(cu_q[-1]), dtype=np.int64) - cu_q[owner] + starts[owner]
    bs = seqs[0].block_size
    slots = tables.slots(rows[owner], positions, bs)
    input_ids = np.fromiter(chain.from_iterable(s.token_ids[a:b] for s, a, b in
                                                zip(seqs, starts.tolist(), ends.tolist())), np.int64, int(cu_q[-1]))
    samples = ends == totals
    last_rows = cu_q[1:] - 1
    sample_rows = last_rows[samples]
    sampled = [s for s, x in zip(seqs, samples.tolist()) if x]
    in_flight = samples & (pending >= 0)
    pending_rows: list | np.ndarray = []
    if in_flight.any():
        pending_rows = np.full(int(cu_q[-1]), -1, dtype=np.int64)
        pending_rows[last_rows[in_flight]] = pending[in_flight]
        input_ids[last_rows[in_flight]] = 0
    has_prefix = bool(starts.any())
    one_token = (counts == 1) & (starts > 0)
    num_decode = n if bool(one_token.all()) else int(np.argmin(one_token))  # the leading run of decode rows
    order = longest_first(ends[:num_decode]) if num_decode else []
    ids_t, pos_t, slots_t, rows_t, pend_t, table_rows_t, order_t = uploader.upload(
        torch.int64, input_ids, positions, slots, sample_rows, pending_rows, rows, order)
    lens_t, cu_q_t, cu_k_t = uploader.upload(torch.int32, ends, cu_q, cu_k)
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=tables.gather(table_rows_t) if has_prefix else None,
        cu_seqlens_q=cu_q_t,
        cu_seqlens_k=cu_k_t,
        max_seqlen_q=int(counts.max()),
        max_seqlen_k=int(ends.max()),
        has_prefix=has_prefix,
        num_decode=num_decode,
        rest_max_seqlen_q=int(counts[num_decode:].max()) if num_decode < n else 0,
        rest_has_prefix=bool(starts[num_decode:].any()),
        row_order=order_t if num_decode else None,
        rows=table_rows_t,
    )
    return StepInputs(ids_t, pos_t, metadata, rows_t, sampled, pend_t if len(pending_rows) else None)


@dataclass
class DecodeArrays:
    """A decode step on the host, one entry per sequence."""

    ids: np.ndarray  # 0 where the token is still in flight
    positions: np.ndarray
    slots: np.ndarray
    lens: np.ndarray
    pending: np.ndarray  # row of the in-flight token in the last launch's samples, or -1
    rows: np.ndarray  # rows of the block tables
    table_ids: np.ndarray | None = None  # which allocation holds each row (None: scratch tables)
    deltas: tuple[np.ndarray, np.ndarray] | None = None  # block-table deltas left to send (defer_deltas)
    order: np.ndarray | None = None  # the rows longest context first (AttentionMetadata.row_order)


def decode_arrays(seqs: list[Sequence], uploader: Uploader, tables: BlockTables | None = None,
                  defer_deltas: bool = False) -> tuple[DecodeArrays, BlockTables]:
    """A decode step's arrays; with ``defer_deltas`` the block tables' device-copy deltas are left in
    ``deltas`` for the caller to send (the decode graphs stage them with the step's other inputs)."""
    n = len(seqs)
    deltas = None
    if tables is None:
        tables, rows = scratch_tables(seqs, uploader.device, uploader)
        table_ids = None
    else:
        rows = table_rows(seqs)
        table_ids = np.fromiter((s.table_id for s in seqs), np.int64, n)
        deltas = tables.sync(seqs, rows, uploader, table_ids, defer=defer_deltas)
    lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
    pending = np.fromiter((s.pending_row for s in seqs), np.int64, n)
    positions = lens - 1
    slots = tables.slots(rows, positions, seqs[0].block_size)
    if bool((pending >= 0).all()):
        ids = np.zeros(n, dtype=np.int64)  # every input token is filled in on the device
    else:
        ids = np.fromiter((max(seq.last_token, 0) for seq in seqs), np.int64, n)
    return DecodeArrays(ids, positions, slots, lens, pending, rows, table_ids, deltas, longest_first(lens)), tables


def longest_first(lens: np.ndarray) -> np.ndarray:
    """Row indices by context length, longest first (ties in row order): the decode attention's launch order."""
    return np.argsort(-lens, kind="stable")


class DecodeCarry:
    """The last graph decode step's arrays, kept for the next step when it decodes the same sequences.

    In the overlapped loop a decode step mostly runs the very sequences of the step before, in the same
    order, each one token longer, with that token still in flight in row i of the last launch. Their arrays
    then follow from the last ones by a few vector operations, where ``decode_arrays`` reads five
    attributes of every sequence; only rows whose token opens a new block read their sequence's block table.
    Any other launch in between (prefill, mixed, eager decode) or a read-back of the last step (its tokens
    are no longer in flight) makes ``follow`` decline.
    """

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.seqs: list[Sequence] | None = None
        self.arrays: DecodeArrays | None = None
        self.launched: Any = None

    def keep(self, seqs: list[Sequence], arrays: DecodeArrays, launched: Any) -> None:
        """``seqs`` (a list nobody mutates) were launched with ``arrays``; ``launched.read`` tells when the
        engine has read their tokens back."""
        self.seqs, self.arrays, self.launched = seqs, arrays, launched

    def follow(self, seqs: list[Sequence], tables: BlockTables, uploader: Uploader) -> DecodeArrays | None:
        """``decode_arrays(seqs, ..., defer_deltas=True)`` from the last step's, or None when they do not follow."""
        last = self.arrays
        if last is None or last.table_ids is None or self.launched.read or seqs != self.seqs:
            return None
        positions = last.positions + 1
        block_size = seqs[0].block_size
        # a token at the first slot of a block is the one the scheduler gave a new block for (_make_room)
        grew = np.flatnonzero(positions % block_size == 0)
        deltas = None
        if grew.size:
            deltas = tables.sync([seqs[i] for i in grew.tolist()], last.rows[grew], uploader, last.table_ids[grew],
                                 defer=True)
        slots = tables.slots(last.rows, positions, block_size)
        n = len(seqs)
        # every row one longer: the order by length stands
        return DecodeArrays(np.zeros(n, dtype=np.int64), positions, slots, last.lens + 1,
                            np.arange(n, dtype=np.int64), last.rows, last.table_ids, deltas, last.order)


def prepare_decode(seqs: list[Sequence], uploader: Uploader, tables: BlockTables | None = None) -> StepInputs:
    arrays, tables = decode_arrays(seqs, uploader, tables)
    lens, pending = arrays.lens, arrays.pending
    any_pending = bool((pending >= 0).any())
    ids_t, pos_t, slots_t, rows_t, order_t, pend_t = uploader.upload(
        torch.int64, arrays.ids, arrays.positions, arrays.slots, arrays.rows, arrays.order, pending if any_pending else [])
    lens_t, = uploader.upload(torch.int32, lens)
    metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=tables.gather(rows_t),
        max_seqlen_k=int(lens.max()),
        row_order=order_t,
        rows=rows_t,
    )
    return StepInputs(ids_t, pos_t, metadata, None, list(seqs), pend_t if any_pending else None)


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    use_filters: bool


@dataclass
class GraphSampling:
    """A decode step's sampling rows for the sampler inside the decode graph (``DecodeGraphs.staged_replay``)."""

    f32: np.ndarray  # float32 [temperatures, min_ps, top_ps] (cuda_graphs.F32_ROWS), one column per row
    top_ks: np.ndarray  # int64; <= 0: off
    seeds: np.ndarray
    steps: np.ndarray  # index of the token being generated
    filtered: bool  # some sampling (not greedy) row has top-k or top-p: the graph with the threshold kernel


def _graph_sampling(f32: np.ndarray, top_ks: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> GraphSampling:
    sampling = f32[0] > 0
    if not sampling.any():  # all greedy: no noise, so no keys, and no filter changes an argmax
        n = f32.shape[1]
        return GraphSampling(f32, top_ks, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), False)
    filtered = bool((sampling & ((top_ks > 0) | (f32[2] < 1))).any())
    return GraphSampling(f32, top_ks, seeds, steps, filtered)


class RowSampling:
    """The sampling settings (temperature, min-p, top-p, top-k, seed, prompt length) of the sequence holding
    each block-table row, refreshed only when a row changes hands (a new ``table_id``): a decode step gathers
    its rows' settings with a few array lookups instead of reading every sequence's parameters."""

    def __init__(self, rows: int = 64) -> None:
        self.owner = np.full(rows, -1, dtype=np.int64)
        self.f32 = np.zeros((3, rows), dtype=np.float32)  # temperatures, min_ps, top_ps
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.prompt = np.zeros(rows, dtype=np.int64)

    def _grow(self, rows: int) -> None:
        old = self.owner.shape[0]
        self.owner = np.concatenate([self.owner, np.full(rows - old, -1, dtype=np.int64)])
        self.f32 = np.concatenate([self.f32, np.zeros((3, rows - old), dtype=np.float32)], axis=1)
        self.top_k = np.concatenate([self.top_k, np.zeros(rows - old, dtype=np.int64)])
        self.seed = np.concatenate([self.seed, np.zeros(rows - old, dtype=np.int64)])
        self.prompt = np.concatenate([self.prompt, np.zeros(rows - old, dtype=np.int64)])

    def gather(self, seqs: list[Sequence], arrays: DecodeArrays) -> GraphSampling:
        """``graph_sampling`` of a decode step whose ``decode_arrays`` are ``arrays``."""
        rows, ids = arrays.rows, arrays.table_ids
        if ids is None:
            return graph_sampling(seqs)
        if int(rows.max()) >= self.owner.shape[0]:
            self._grow(max(2 * self.owner.shape[0], int(rows.max()) + 1))
        for i in np.flatnonzero(self.owner[rows] != ids).tolist():
            row, seq = int(rows[i]), seqs[i]
            p = seq.params
            self.owner[row] = ids[i]
            self.f32[:, row] = (p.temperature, p.min_p, p.top_p)
            self.top_k[row], self.seed[row], self.prompt[row] = p.top_k, seq.seed, seq.num_prompt_tokens
        return _graph_sampling(self.f32[:, rows], self.top_k[rows], self.seed[rows], arrays.lens - self.prompt[rows])


def graph_sampling(seqs: list[Sequence]) -> GraphSampling:
    """The sampling rows of a decode step for the sampler inside the decode graph, read from the sequences
    (any new per-request setting of the sampling path belongs here too, and in ``RowSampling``; one the
    graph's sampler cannot apply sends the step through ``ModelRunner.launch``'s eager path, as penalties,
    logprobs and token masks do)."""
    params = [s.params for s in seqs]
    n = len(seqs)
    f32 = np.zeros((3, n), dtype=np.float32)
    f32[0] = np.fromiter((p.temperature for p in params), np.float32, n)
    f32[1] = np.fromiter((p.min_p for p in params), np.float32, n)
    f32[2] = np.fromiter((p.top_p for p in params), np.float32, n)
    top_ks = np.fromiter((p.top_k for p in params), np.int64, n)
    seeds = np.fromiter((s.seed for s in seqs), np.int64, n)
    steps = np.fromiter((len(s.token_ids) - s.num_prompt_tokens for s in seqs), np.int64, n)
    return _graph_sampling(f32, top_ks, seeds, steps)


def all_greedy(seqs: list[Sequence]) -> bool:
    return all(s.params.temperature == 0 for s in seqs)


def prepare_sampling(seqs: list[Sequence], uploader: Uploader) -> SamplingTensors:
    params = [s.params for s in seqs]
    temps, top_ps, min_ps = uploader.upload(torch.float32, [p.temperature for p in params],
                                            [p.top_p for p in params], [p.min_p for p in params])
    top_ks, seeds, steps = uploader.upload(torch.int64, [p.top_k for p in params], [s.seed for s in seqs],
                                           [s.num_completion_tokens for s in seqs])
    return SamplingTensors(temps, top_ks, top_ps, min_ps, seeds, steps,
                           use_filters=any(p.top_k > 0 or p.top_p < 1 for p in params))
