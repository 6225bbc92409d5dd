"""The scheduler side of a step's extras: which sampled rows want penalties, logit biases, min_tokens holds and
logprobs, planned from the Sequences into an ``ExtrasPlan`` (plain lists; ``engine/sampling_extras.py``
uploads them and runs them on the device). A step in which no request asks for any costs one scan.
"""
from __future__ import annotations

from llmcli.engine.sequence import PENDING_TOKEN, Sequence
from llmcli.engine.step_plan import ExtrasPlan


class TableRows:
    """Which rows of a device token table (penalties, or logit biases) hold which sequence's tokens. A
    sequence's row is its block-table row, as in the runner's row table; it is filled afresh when the row
    changes hands (another allocation, ``table_id``, holds it: a new request, or one admitted again after
    preemption, whose generated tokens are then counted again). ``size``: the rows the device table needs."""

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}  # row -> the table_id it was filled for
        self.counted: dict[int, int] = {}  # row -> completion tokens already in its counts
        self.size = 0

    def slot(self, seq: Sequence) -> tuple[int, bool]:
        """The sequence's row, and whether it is new to this table (to be cleared and filled)."""
        row = seq.table_row
        new = self.owner.get(row) != seq.table_id
        if new:
            self.owner[row], self.counted[row] = seq.table_id, 0
            self.size = max(self.size, row + 1)
        return row, new


class ExtrasPlanner:
    def __init__(self) -> None:
        self.penalty_slots = TableRows()
        self.bias_slots = TableRows()

    def plan(self, seqs: list[Sequence], sampled: list[Sequence]) -> ExtrasPlan | None:
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
        extras = ExtrasPlan()
        if any(wants_bias):
            self._bias(extras, sampled, wants_bias)
        if held:
            pairs = [(i, t) for i in held for t in sampled[i].hold_ids]
            extras.hold = ([i for i, _ in pairs], [t for _, t in pairs])
        if any(wants_pen):
            last_input_row, offset = {}, 0
            for s in seqs:
                offset += s.num_scheduled_tokens
                last_input_row[s.seq_id] = offset - 1
            self._penalties(extras, sampled, wants_pen, last_input_row)
        if any(wants_lp):
            extras.lp_rows = [i for i, w in enumerate(wants_lp) if w]
            extras.lp_ks = [sampled[i].params.logprobs for i in extras.lp_rows]
        if wants_prompt:
            _plan_prompt(extras, seqs)
        return extras

    def _penalties(self, extras: ExtrasPlan, sampled: list[Sequence], wants: list[bool], last_input_row: dict) -> None:
        slots = self.penalty_slots
        new_rows, prompt_rows, prompt_ids = extras.pen_start
        known_rows, known_ids = extras.pen_known
        flight_rows, flight_inputs = extras.pen_from_input
        for i, (seq, want) in enumerate(zip(sampled, wants)):
            if not want:
                continue
            row, new = slots.slot(seq)
            if new:
                prompt = seq.token_ids[:seq.num_prompt_tokens]
                new_rows.append(row)
                prompt_rows += [row] * len(prompt)
                prompt_ids += prompt
            done, total = slots.counted[row], seq.num_completion_tokens
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
                slots.counted[row] = total
            extras.pen_logit_rows.append(i)
            extras.pen_rows.append(row)
        extras.pen_slots = slots.size

    def _bias(self, extras: ExtrasPlan, sampled: list[Sequence], wants: list[bool]) -> None:
        slots = self.bias_slots
        new_rows, closed, allow_rows, allow_ids, add_rows, add_ids, ban_rows, ban_ids = start = \
            [], [], [], [], [], [], [], []
        for i, (seq, want) in enumerate(zip(sampled, wants)):
            if not want:
                continue
            row, new = slots.slot(seq)
            extras.bias_logit_rows.append(i)
            extras.bias_rows.append(row)
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
            extras.bias_values += bias.values()
            ban_rows += [row] * len(seq.banned_token_ids)
            ban_ids += seq.banned_token_ids
        if new_rows:
            extras.bias_start = tuple(start)
        extras.bias_slots = slots.size


def _plan_prompt(extras: ExtrasPlan, seqs: list[Sequence]) -> None:
    """Rows of prompt positions whose next token is a prompt token (the last one's is sampled instead)."""
    offset = 0
    for entry, seq in enumerate(seqs):
        k = seq.params.prompt_logprobs
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        if k is not None:
            first = max(start, seq.prompt_logprobs_done)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                extras.prompt_rows += range(offset + first - start, offset + last - start)
                extras.prompt_targets += seq.token_ids[first + 1:last + 1]
                extras.prompt_parts.append((entry, first, last - first, k))
                seq.prompt_logprobs_done = last
        offset += n
