"""What a step computes beside the sampled tokens: penalties and logit biases before sampling, logprobs after.

The host side of ``llmcli.layers.penalties``, ``llmcli.layers.logit_bias`` and ``llmcli.layers.logprobs``: which
rows of the step want what, planned from the Sequences in one pass, and the
results put back on the Sequences when the step is read back. A step in which no
request asks for penalties or logprobs plans nothing and costs one scan of its
sampling parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmcli.engine.sequence import PENDING_TOKEN, Sequence
from llmcli.layers.logprobs import TokenLogprobs, chunked_token_logprobs, token_logprobs
from llmcli.layers.logit_bias import BiasTables, hold_back
from llmcli.layers.penalties import PenaltyTables


class PenaltyRows:
    """Which row of per-request token tables (penalties, or logit biases) each sequence owns; rows of finished
    ones are reused."""

    def __init__(self, tables: PenaltyTables | BiasTables) -> None:
        self.tables = tables
        self.owner: dict[int, Sequence] = {}  # row -> sequence
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.counted: dict[int, int] = {}  # seq_id -> completion tokens already in its counts

    def row(self, seq: Sequence) -> tuple[int, bool]:
        """The sequence's row, and whether it is new (to be cleared and given the prompt)."""
        row = self.row_of.get(seq.seq_id)
        if row is not None:
            return row, False
        for r, other in list(self.owner.items()):
            if other.is_finished:  # device work of a late step on this row runs before the reuse: same stream
                del self.owner[r], self.row_of[other.seq_id], self.counted[other.seq_id]
        free = next((r for r in range(self.tables.capacity) if r not in self.owner), None)
        if free is None:
            free = self.tables.capacity
            self.tables.reserve(free + 1)
        self.owner[free], self.row_of[seq.seq_id], self.counted[seq.seq_id] = seq, free, 0
        return free, True


@dataclass
class StepExtras:
    """One step's plan (device tensors) and, after launch, its results on the device."""

    # penalties: logit rows, their table rows, the per-row settings
    pen_logit_rows: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None
    pen_settings: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    start: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # new rows; prompt (row, id) pairs
    add_known: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, id) of host-known new tokens
    add_from_input: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, input row): in-flight tokens
    # logit biases: logit rows, their bias-table rows, the new rows' contents; min_tokens' (logit row, id) pairs
    bias_logit_rows: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_start: tuple | None = None
    hold: tuple[torch.Tensor, torch.Tensor] | None = None
    # logprobs of sampled tokens: which sampled rows, and k (the largest asked in the step)
    lp_rows: torch.Tensor | None = None  # None when every sampled row asks (lp_all)
    lp_all: bool = False
    lp_row_list: list[int] = field(default_factory=list)
    lp_ks: list[int] = field(default_factory=list)
    lp_k: int = 0
    # prompt logprobs: per sequence (seq, first target position, count, k); hidden rows and targets
    prompt_parts: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_k: int = 0
    # results on the device
    sampled: TokenLogprobs | None = None
    prompt: TokenLogprobs | None = None

    def penalize(self, logits: torch.Tensor, input_ids: torch.Tensor, tables: PenaltyTables,
                 bias: BiasTables | None = None) -> torch.Tensor:
        if self.bias_rows is not None:
            if self.bias_start is not None:
                rows, closed, *pairs = self.bias_start
                bias.start(rows, closed, tuple(pairs[0:2]), tuple(pairs[2:5]), tuple(pairs[5:7]))
            logits = bias.apply(logits, self.bias_logit_rows, self.bias_rows)
        if self.hold is not None:
            logits = hold_back(logits, *self.hold)
        if self.pen_rows is None:
            return logits
        if self.start is not None:
            tables.start(*self.start)
        if self.add_known is not None:
            tables.add(*self.add_known)
        if self.add_from_input is not None:
            rows, input_rows = self.add_from_input
            tables.add(rows, input_ids[input_rows])
        return tables.apply(logits, self.pen_logit_rows, self.pen_rows, *self.pen_settings)

    def compute_logprobs(self, raw_logits: torch.Tensor | None, token_ids: torch.Tensor | None,
                         hidden: torch.Tensor, compute_logits) -> None:
        if self.lp_row_list and raw_logits is not None:
            if self.lp_all:  # every row asks: no gather
                self.sampled = token_logprobs(raw_logits, token_ids, self.lp_k)
            else:
                self.sampled = token_logprobs(raw_logits[self.lp_rows], token_ids[self.lp_rows], self.lp_k)
        if self.prompt_rows is not None:
            self.prompt = chunked_token_logprobs(hidden[self.prompt_rows], self.prompt_targets, self.prompt_k,
                                                 compute_logits)

    def device_tensors(self) -> list[torch.Tensor]:
        """Everything to copy back with the step's tokens, in the order ``host_results`` reads it."""
        out: list[torch.Tensor] = []
        for part in (self.sampled, self.prompt):
            if part is not None:
                out += [part.logprobs, part.ranks, part.top_ids, part.top_logprobs]
        return out

    def host_results(self, host: list[torch.Tensor]) -> "StepLogprobs":
        """The copied-back tensors as plain lists, per sampled row and per prompt part."""
        result = StepLogprobs()
        if self.sampled is not None:
            result.block = LogprobBlock(*(t.reshape(-1).tolist() for t in host[:4]), self.lp_k)
            host = host[4:]
            if not self.lp_all:
                result.block_rows = [-1] * (self.lp_row_list[-1] + 1)
                for i, row in enumerate(self.lp_row_list):
                    result.block_rows[row] = i
        if self.prompt is not None:
            lps, ranks, ids, tops = (t.tolist() for t in host[:4])
            at = 0
            for seq, first, count, k in self.prompt_parts:
                entries = [(lps[j], ranks[j], ids[j][:k], tops[j][:k]) for j in range(at, at + count)]
                result.prompt.append((seq, first, entries))
                at += count
        return result


class LogprobBlock:
    """One step's sampled-token logprobs on the host, as flat lists (a handful of objects per step).

    A sequence keeps (block, row) per token and the entries are cut out when its output is built:
    one tuple and two lists per token per step would make the step loop's host work grow with the batch
    and feed Python's garbage collector hundreds of thousands of live containers over a long run."""

    __slots__ = ("logprobs", "ranks", "top_ids", "top_logprobs", "width")

    def __init__(self, logprobs: list[float], ranks: list[int], top_ids: list[int], top_logprobs: list[float],
                 width: int) -> None:
        self.logprobs, self.ranks, self.top_ids, self.top_logprobs, self.width = \
            logprobs, ranks, top_ids, top_logprobs, width

    def entry(self, row: int, k: int) -> tuple[float, int, list[int], list[float]]:
        """(logprob, rank, top ids, top logprobs) of one row, its ``k`` likeliest tokens."""
        at = row * self.width
        return self.logprobs[row], self.ranks[row], self.top_ids[at:at + k], self.top_logprobs[at:at + k]


@dataclass
class StepLogprobs:
    """Host copies: the sampled rows' block (``block_rows``: block row of each sampled row, -1 where the row
    did not ask, shorter than the step where the last rows did not; None: row i is block row i); prompt
    parts per sequence."""

    block: LogprobBlock | None = None
    block_rows: list[int] | None = None
    prompt: list[tuple[Sequence, int, list[tuple[float, int, list[int], list[float]]]]] = field(default_factory=list)


def plan_extras(seqs: list[Sequence], sampled: list[Sequence], uploader, penalty_rows: PenaltyRows,
                bias_rows: PenaltyRows | None = None) -> StepExtras | None:
    """The extras of one step over ``seqs`` (scheduled, in input order) of which ``sampled`` sample."""
    if not any(s.wants_extras for s in seqs):
        return None
    wants_lp = [s.params.logprobs is not None for s in sampled]
    wants_pen = [s.params.has_penalties for s in sampled]
    wants_bias = [s.params.has_token_bias for s in sampled]
    # min_tokens: completion tokens so far (in-flight ones counted) below the minimum
    held = [i for i, s in enumerate(sampled) if s.hold_ids and s.num_completion_tokens < s.params.min_tokens]
    wants_prompt = any(s.params.prompt_logprobs is not None and s.prompt_logprobs_done < s.num_prompt_tokens - 1
                       for s in seqs)
    if not (any(wants_lp) or any(wants_pen) or any(wants_bias) or held or wants_prompt):
        return None
    extras = StepExtras()
    if any(wants_bias):
        _plan_bias(extras, sampled, wants_bias, uploader, bias_rows)
    if held:
        pairs = [(i, t) for i in held for t in sampled[i].hold_ids]
        extras.hold = tuple(uploader.upload(torch.int64, [i for i, _ in pairs], [t for _, t in pairs]))
    if any(wants_pen):
        last_input_row, offset = {}, 0
        for s in seqs:
            offset += s.num_scheduled_tokens
            last_input_row[s.seq_id] = offset - 1
        _plan_penalties(extras, sampled, wants_pen, last_input_row, uploader, penalty_rows)
    if any(wants_lp):
        rows = [i for i, w in enumerate(wants_lp) if w]
        extras.lp_row_list, extras.lp_ks = rows, [sampled[i].params.logprobs for i in rows]
        extras.lp_k = max(extras.lp_ks)
        extras.lp_all = len(rows) == len(sampled)
        # every row asks (the usual batch): no row list to upload, no gather of the logits
        extras.lp_rows = None if extras.lp_all else uploader.upload(torch.int64, rows)[0]
    if wants_prompt:
        _plan_prompt(extras, seqs, uploader)
    return extras


def _plan_penalties(extras: StepExtras, sampled: list[Sequence], wants: list[bool], last_input_row: dict,
                    uploader, penalty_rows: PenaltyRows) -> None:
    logit_rows, rows, reps, pres, freqs = [], [], [], [], []
    new_rows, prompt_rows, prompt_ids, known_rows, known_ids, flight_rows, flight_inputs = [], [], [], [], [], [], []
    for i, (seq, want) in enumerate(zip(sampled, wants)):
        if not want:
            continue
        row, new = penalty_rows.row(seq)
        if new:
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            new_rows.append(row)
            prompt_rows += [row] * len(prompt)
            prompt_ids += prompt
        done, total = penalty_rows.counted[seq.seq_id], seq.num_completion_tokens
        if total > done:
            fresh = seq.token_ids[seq.num_prompt_tokens + done:]
            # the sequence's last token is its last input of this step: take it from the device, where an
            # in-flight token already is
            known = fresh[:-1]
            known_rows += [row] * len(known)
            known_ids += known
            flight_rows.append(row)
            flight_inputs.append(last_input_row[seq.seq_id])
            assert PENDING_TOKEN not in known, "only a sequence's last token can be in flight"
            penalty_rows.counted[seq.seq_id] = total
        logit_rows.append(i)
        rows.append(row)
        p = seq.params
        reps.append(p.repetition_penalty)
        pres.append(p.presence_penalty)
        freqs.append(p.frequency_penalty)
    ints = uploader.upload(torch.int64, logit_rows, rows, new_rows, prompt_rows, prompt_ids, known_rows, known_ids,
                           flight_rows, flight_inputs)
    extras.pen_logit_rows, extras.pen_rows = ints[0], ints[1]
    extras.pen_settings = tuple(uploader.upload(torch.float32, reps, pres, freqs))
    if new_rows:
        extras.start = (ints[2], ints[3], ints[4])
    if known_rows:
        extras.add_known = (ints[5], ints[6])
    if flight_rows:
        extras.add_from_input = (ints[7], ints[8])


def _plan_bias(extras: StepExtras, sampled: list[Sequence], wants: list[bool], uploader,
               bias_rows: PenaltyRows) -> None:
    logit_rows, rows, new_rows, closed = [], [], [], []
    allow_rows, allow_ids, add_rows, add_ids, add_vals, ban_rows, ban_ids = [], [], [], [], [], [], []
    for i, (seq, want) in enumerate(zip(sampled, wants)):
        if not want:
            continue
        row, new = bias_rows.row(seq)
        logit_rows.append(i)
        rows.append(row)
        if not new:
            continue
        p = seq.params
        new_rows.append(row)
        closed.append(int(p.allowed_token_ids is not None))
        allowed = p.allowed_token_ids or []
        allow_rows += [row] * len(allowed)
        allow_ids += allowed
        bias = p.logit_bias or {}
        add_rows += [row] * len(bias)
        add_ids += bias
        add_vals += bias.values()
        ban_rows += [row] * len(seq.banned_token_ids)
        ban_ids += seq.banned_token_ids
    ints = uploader.upload(torch.int64, logit_rows, rows, new_rows, closed, allow_rows, allow_ids, add_rows,
                           add_ids, ban_rows, ban_ids)
    extras.bias_logit_rows, extras.bias_rows = ints[0], ints[1]
    if new_rows:
        (vals,) = uploader.upload(torch.float32, add_vals)
        extras.bias_start = (ints[2], ints[3] != 0, ints[4], ints[5], ints[6], ints[7], vals, ints[8], ints[9])


def _plan_prompt(extras: StepExtras, seqs: list[Sequence], uploader) -> None:
    """Rows of prompt positions whose next token is a prompt token (the last one's is sampled instead)."""
    hidden_rows, targets, offset = [], [], 0
    for seq in seqs:
        k = seq.params.prompt_logprobs
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        if k is not None:
            first = max(start, seq.prompt_logprobs_done)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                hidden_rows += range(offset + first - start, offset + last - start)
                targets += seq.token_ids[first + 1:last + 1]
                extras.prompt_parts.append((seq, first, last - first, k))
                extras.prompt_k = max(extras.prompt_k, k)
                seq.prompt_logprobs_done = last
        offset += n
    if hidden_rows:
        extras.prompt_rows, extras.prompt_targets = uploader.upload(torch.int64, hidden_rows, targets)
