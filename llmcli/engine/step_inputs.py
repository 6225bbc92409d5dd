"""Turning one scheduled step into flat tensors: token ids, positions, attention metadata, sampling rows.

Everything a step sends to the device goes through one ``Uploader`` call per
dtype: the host values are packed into a reused pinned buffer and cross to the
device in a single copy, then split into views. A decode step at batch 256
thus costs three small transfers instead of a dozen.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmcli.engine.sequence import Sequence
from llmcli.kernels.backend import AttentionMetadata

_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


ALIGN = 16  # elements: every part starts 64- or 128-byte aligned in the packed buffer


class Uploader:
    """Packs lists of numbers into one pinned host tensor per dtype and copies it to the device at once.

    Each part starts at a multiple of ``ALIGN`` elements: Triton and Inductor compile a separate kernel
    for a pointer that is not 16-byte aligned, so parts at arbitrary offsets would trigger fresh
    compilations whenever a step's sizes change the alignment. Each upload takes a fresh pinned tensor
    from PyTorch's caching host allocator, which hands a block out again only after the copy reading it
    has run; so the host never waits for the device here.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, dtype: torch.dtype, *parts: list) -> list[torch.Tensor]:
        starts, total = [], 0
        for part in parts:
            starts.append(total)
            total += -(-len(part) // ALIGN) * ALIGN
        values = np.zeros(max(total, 1), dtype=_NP[dtype])
        for start, part in zip(starts, parts):
            values[start:start + len(part)] = part
        packed = torch.from_numpy(values)
        if self.device.type == "cuda":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        return [packed[start:start + len(part)] for start, part in zip(starts, parts)]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to compute logits for (None: every row)
    sampled_seqs: list[Sequence]  # the sequences that get a new token this step, in row order
    pending_rows: torch.Tensor | None = None  # decode: row of each input token in the last launch's samples, or -1


def padded_block_tables(seqs: list[Sequence]) -> tuple[list[int], int]:
    """Every block table padded with -1 to the longest, flattened row by row; and that width."""
    width = max(len(s.block_table) for s in seqs)
    flat = list(chain.from_iterable(s.block_table + [-1] * (width - len(s.block_table)) for s in seqs))
    return flat, width


def slots_for(seq: Sequence, start: int, end: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of ``seq``."""
    bs, table, slots = seq.block_size, seq.block_table, []
    for b in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
        base = table[b] * bs - b * bs
        slots.extend(range(base + lo, base + hi))
    return slots


def prepare_prefill(seqs: list[Sequence], uploader: Uploader) -> StepInputs:
    input_ids, positions, slots, cu_q, cu_k, lens, rows, sampled = [], [], [], [0], [0], [], [], []
    has_prefix = False
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(slots_for(seq, start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        lens.append(end)
        has_prefix |= start > 0
        if seq.samples_this_step:
            rows.append(cu_q[-1] - 1)
            sampled.append(seq)
    tables, width = padded_block_tables(seqs) if has_prefix else ([], 0)
    ids_t, pos_t, slots_t, rows_t = uploader.upload(torch.int64, input_ids, positions, slots, rows)
    lens_t, cu_q_t, cu_k_t, tables_t = uploader.upload(torch.int32, lens, cu_q, cu_k, tables)
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=tables_t.view(len(seqs), width) if has_prefix else None,
        cu_seqlens_q=cu_q_t,
        cu_seqlens_k=cu_k_t,
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max_seqlen_k=max(lens),
        has_prefix=has_prefix,
    )
    return StepInputs(ids_t, pos_t, metadata, rows_t, sampled)


def prepare_decode(seqs: list[Sequence], uploader: Uploader) -> StepInputs:
    positions = [seq.num_tokens - 1 for seq in seqs]
    slots = [seq.block_table[p // seq.block_size] * seq.block_size + p % seq.block_size
             for seq, p in zip(seqs, positions)]
    lens = [p + 1 for p in positions]
    tables, width = padded_block_tables(seqs)
    pending = [seq.pending_row for seq in seqs]
    any_pending = max(pending) >= 0
    ids = [max(seq.last_token, 0) for seq in seqs]  # an in-flight token is filled in on the device
    ids_t, pos_t, slots_t, rows_t = uploader.upload(torch.int64, ids, positions, slots, pending if any_pending else [])
    lens_t, tables_t = uploader.upload(torch.int32, lens, tables)
    metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=tables_t.view(len(seqs), width),
        max_seqlen_k=max(lens),
    )
    return StepInputs(ids_t, pos_t, metadata, None, list(seqs), rows_t if any_pending else None)


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    use_filters: bool


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
