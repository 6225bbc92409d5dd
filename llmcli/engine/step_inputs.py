"""Turning one step plan into flat tensors: token ids, positions, attention metadata.

Everything a step sends to the device goes through one ``Uploader`` call per
dtype: the host values are packed into a reused pinned buffer and cross to the
device in a single copy, then split into views. A decode step at batch 256
thus costs three small transfers instead of a dozen.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmcli.engine.block_tables import BlockTables
from llmcli.engine.step_plan import StepPlan
from llmcli.engine.uploader import Uploader
from llmcli.kernels.backend import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to compute logits for (None: every row)
    num_sampled: int  # entries that get a new token this step (their rows of the output, in entry order)
    pending_rows: torch.Tensor | None = None  # row of each input token in the last launch's samples, or -1


GroupTables = BlockTables | list[BlockTables]  # one block table per KV group (engine/kv_groups.py), or the one


def _groups(tables: GroupTables) -> list[BlockTables]:
    return tables if isinstance(tables, list) else [tables]


def prepare_prefill(plan: StepPlan, uploader: Uploader, tables: GroupTables) -> StepInputs:
    """A varlen batch of chunks: prompt chunks, and (in a mixed step) decode rows as chunks of one token.

    A chunk whose last token is still in flight on the device (a decoding sequence in the overlapped loop)
    takes it from the previous launch's sampled tokens through ``pending_rows``. Slots and block tables come
    per KV group (``tables``: the first group's are ``slot_mapping`` / ``block_tables``).
    """
    groups = _groups(tables)
    n = plan.num_entries
    rows, starts, counts, pending = plan.rows, plan.computed, plan.scheduled, plan.pending
    ends = starts + counts
    cu_q = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=cu_q[1:])
    cu_k = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ends, out=cu_k[1:])
    owner = np.repeat(np.arange(n), counts)  # which chunk each token belongs to
    positions = np.arange(int(cu_q[-1]), dtype=np.int64) - cu_q[owner] + starts[owner]
    slots = [t.slots(rows[owner], positions) for t in groups]
    last_rows = cu_q[1:] - 1
    sample_rows = last_rows[plan.samples]
    in_flight = pending >= 0
    pending_rows: list | np.ndarray = []
    if in_flight.any():
        pending_rows = np.full(int(cu_q[-1]), -1, dtype=np.int64)
        pending_rows[last_rows[in_flight]] = pending[in_flight]
    has_prefix = bool(starts.any())
    one_token = (counts == 1) & (starts > 0)
    num_decode = n if bool(one_token.all()) else int(np.argmin(one_token))  # the leading run of decode rows
    order = longest_first(ends[:num_decode]) if num_decode else []
    ids_t, pos_t, rows_t, pend_t, table_rows_t, order_t, *slots_t = uploader.upload(
        torch.int64, plan.tokens, positions, sample_rows, pending_rows, rows, order, *slots)
    lens_t, cu_q_t, cu_k_t, cached_t = uploader.upload(torch.int32, ends, cu_q, cu_k, starts > 0)
    gathered = [t.gather(table_rows_t) if has_prefix else None for t in groups]
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slots_t[0],
        context_lens=lens_t,
        block_tables=gathered[0],
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
        has_initial_state=cached_t != 0,
        group_slots=tuple(slots_t[1:]),
        group_tables=tuple(gathered[1:]),
    )
    return StepInputs(ids_t, pos_t, metadata, rows_t, len(sample_rows), pend_t if len(pending_rows) else None)


@dataclass
class DecodeArrays:
    """A decode step on the host, one entry per sequence."""

    ids: np.ndarray  # 0 where the token is still in flight
    positions: np.ndarray
    slots: np.ndarray  # KV group 0's
    lens: np.ndarray
    pending: np.ndarray  # row of the in-flight token in the last launch's samples, or -1
    rows: np.ndarray  # rows of the block tables
    order: np.ndarray | None = None  # the rows longest context first (AttentionMetadata.row_order)
    group_slots: tuple[np.ndarray, ...] = ()  # the other KV groups' slots


def decode_arrays(plan: StepPlan, tables: GroupTables, last: DecodeArrays | None = None) -> DecodeArrays:
    """A decode step's arrays; ``last``: the previous decode step's, which a plan that ``follows`` it reuses
    the launch order of (every row one longer: the order by length stands)."""
    positions = plan.computed
    lens = positions + 1
    order = last.order if plan.follows and last is not None else longest_first(lens)
    groups = _groups(tables)
    return DecodeArrays(plan.tokens, positions, groups[0].slots(plan.rows, positions), lens, plan.pending, plan.rows,
                        order, tuple(t.slots(plan.rows, positions) for t in groups[1:]))


def longest_first(lens: np.ndarray) -> np.ndarray:
    """Row indices by context length, longest first (ties in row order): the decode attention's launch order."""
    return np.argsort(-lens, kind="stable")


def prepare_decode(plan: StepPlan, uploader: Uploader, tables: GroupTables) -> StepInputs:
    groups = _groups(tables)
    arrays = decode_arrays(plan, groups)
    lens, pending = arrays.lens, arrays.pending
    any_pending = bool((pending >= 0).any())
    ids_t, pos_t, slots_t, rows_t, order_t, pend_t, *group_slots = uploader.upload(
        torch.int64, arrays.ids, arrays.positions, arrays.slots, arrays.rows, arrays.order, pending if any_pending else [],
        *arrays.group_slots)
    lens_t, = uploader.upload(torch.int32, lens)
    metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=groups[0].gather(rows_t),
        max_seqlen_k=int(lens.max()),
        row_order=order_t,
        rows=rows_t,
        group_slots=tuple(group_slots),
        group_tables=tuple(t.gather(rows_t) for t in groups[1:]),
    )
    return StepInputs(ids_t, pos_t, metadata, None, plan.num_entries, pend_t if any_pending else None)
