"""Turning one scheduled step into flat tensors: token ids, positions, attention metadata, sampling rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmcli.engine.sequence import Sequence
from llmcli.kernels.backend import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to compute logits for (None: every row)
    sampled_seqs: list[Sequence]  # the sequences that get a new token this step, in row order


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def block_table_tensor(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
    return _to_device(rows, torch.int32, device)


def slots_for(seq: Sequence, start: int, end: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of ``seq``."""
    bs, table, slots = seq.block_size, seq.block_table, []
    for b in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
        base = table[b] * bs - b * bs
        slots.extend(range(base + lo, base + hi))
    return slots


def prepare_prefill(seqs: list[Sequence], device: torch.device) -> StepInputs:
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
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=_to_device(slots, torch.int64, device),
        context_lens=_to_device(lens, torch.int32, device),
        block_tables=block_table_tensor(seqs, device) if has_prefix else None,
        cu_seqlens_q=_to_device(cu_q, torch.int32, device),
        cu_seqlens_k=_to_device(cu_k, torch.int32, device),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max_seqlen_k=max(lens),
        has_prefix=has_prefix,
    )
    return StepInputs(_to_device(input_ids, torch.int64, device), _to_device(positions, torch.int64, device),
                      metadata, _to_device(rows, torch.int64, device), sampled)


def prepare_decode(seqs: list[Sequence], device: torch.device) -> StepInputs:
    positions = [seq.num_tokens - 1 for seq in seqs]
    slots = [seq.block_table[p // seq.block_size] * seq.block_size + p % seq.block_size
             for seq, p in zip(seqs, positions)]
    metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=_to_device(slots, torch.int64, device),
        context_lens=_to_device([seq.num_tokens for seq in seqs], torch.int32, device),
        block_tables=block_table_tensor(seqs, device),
        max_seqlen_k=max(seq.num_tokens for seq in seqs),
    )
    return StepInputs(_to_device([seq.last_token for seq in seqs], torch.int64, device),
                      _to_device(positions, torch.int64, device), metadata, None, list(seqs))


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    all_greedy: bool
    use_filters: bool


def prepare_sampling(seqs: list[Sequence], device: torch.device) -> SamplingTensors:
    params = [s.params for s in seqs]
    return SamplingTensors(
        temperatures=_to_device([p.temperature for p in params], torch.float32, device),
        top_ks=_to_device([p.top_k for p in params], torch.int64, device),
        top_ps=_to_device([p.top_p for p in params], torch.float32, device),
        min_ps=_to_device([p.min_p for p in params], torch.float32, device),
        seeds=_to_device([s.seed for s in seqs], torch.int64, device),
        steps=_to_device([s.num_completion_tokens for s in seqs], torch.int64, device),
        all_greedy=all(p.temperature == 0 for p in params),
        use_filters=any(p.top_k > 0 or p.top_p < 1 for p in params),
    )
