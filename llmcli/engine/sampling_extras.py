"""What a step computes beside the sampled tokens: penalties and logit biases before sampling, logprobs after.

The runner's side of ``llmcli.layers.penalties``, ``llmcli.layers.logit_bias`` and ``llmcli.layers.logprobs``:
a step plan's ``ExtrasPlan`` (which rows want what, planned by ``engine/extras_plan.py``) uploaded as device
tensors, run around the sampler, and the logprobs handed back per sampled row and per prompt part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmcli.engine.row_table import RowTable
from llmcli.engine.step_plan import ExtrasPlan
from llmcli.layers.logprobs import TokenLogprobs, chunked_token_logprobs, token_logprobs
from llmcli.layers.logit_bias import BiasTables, hold_back
from llmcli.layers.penalties import PenaltyTables


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
    # prompt logprobs: per entry (entry index, first target position, count, k); hidden rows and targets
    prompt_parts: list[tuple[int, int, int, int]] = field(default_factory=list)
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
            for entry, first, count, k in self.prompt_parts:
                entries = [(lps[j], ranks[j], ids[j][:k], tops[j][:k]) for j in range(at, at + count)]
                result.prompt.append((entry, first, entries))
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
    parts per entry of the step (its index in the plan)."""

    block: LogprobBlock | None = None
    block_rows: list[int] | None = None
    prompt: list[tuple[int, int, list[tuple[float, int, list[int], list[float]]]]] = field(default_factory=list)


def upload_extras(plan: ExtrasPlan, num_sampled: int, uploader, penalties: PenaltyTables,
                  bias: BiasTables, rows: RowTable) -> StepExtras:
    """A step's ``ExtrasPlan`` as device tensors (each dtype in one upload); grows the token tables to fit.
    The penalty values come from the row table (``rows``), set when each row changed hands."""
    extras = StepExtras()
    i64 = torch.int64
    if plan.pen_rows:
        penalties.reserve(plan.pen_slots)
        new, prompt_rows, prompt_ids = plan.pen_start
        ints = uploader.upload(i64, plan.pen_logit_rows, plan.pen_rows, new, prompt_rows, prompt_ids,
                               *plan.pen_known, *plan.pen_from_input)
        extras.pen_logit_rows, extras.pen_rows = ints[0], ints[1]
        extras.pen_settings = rows.penalties(plan.pen_rows, uploader)
        if new:
            extras.start = (ints[2], ints[3], ints[4])
        if plan.pen_known[0]:
            extras.add_known = (ints[5], ints[6])
        if plan.pen_from_input[0]:
            extras.add_from_input = (ints[7], ints[8])
    if plan.bias_rows:
        bias.reserve(plan.bias_slots)
        extras.bias_logit_rows, extras.bias_rows = uploader.upload(i64, plan.bias_logit_rows, plan.bias_rows)
        if plan.bias_start:
            ints = uploader.upload(i64, *plan.bias_start)
            (values,) = uploader.upload(torch.float32, plan.bias_values)
            extras.bias_start = (ints[0], ints[1] != 0, ints[2], ints[3], ints[4], ints[5], values, ints[6], ints[7])
    if plan.hold[0]:
        extras.hold = tuple(uploader.upload(i64, *plan.hold))
    if plan.lp_rows:
        extras.lp_row_list, extras.lp_ks = plan.lp_rows, plan.lp_ks
        extras.lp_k = max(plan.lp_ks)
        extras.lp_all = len(plan.lp_rows) == num_sampled
        # every row asks (the usual batch): no row list to upload, no gather of the logits
        extras.lp_rows = None if extras.lp_all else uploader.upload(i64, plan.lp_rows)[0]
    if plan.prompt_rows:
        extras.prompt_parts = plan.prompt_parts
        extras.prompt_k = max(k for *_, k in plan.prompt_parts)
        extras.prompt_rows, extras.prompt_targets = uploader.upload(i64, plan.prompt_rows, plan.prompt_targets)
    return extras
