"""The scheduler side of the step plan: ``StepPlan``s written from the scheduled ``Sequence`` objects.

The builder remembers, per block-table row, which allocation (``table_id``) it last described and how many
of its blocks it has sent, so a plan carries only what changed: the settings of rows that changed hands and
the blocks appended since. A decode step over the very entries of the previous one, each token still in
flight, follows from the last plan by a few vector operations instead of reading every sequence.
"""
from __future__ import annotations

import numpy as np

from llmcli.engine.extras_plan import ExtrasPlanner
from llmcli.engine.sequence import Sequence
from llmcli.engine.step_plan import RowSettings, StepPlan


def _valid(block_ids: list[int]) -> list[int]:
    """Block ids for the runner's tables: a released window block (NULL_BLOCK, only ever before the window,
    which no kernel reads) as block 0, so that every entry is an index into the cache."""
    return [max(b, 0) for b in block_ids] if block_ids and min(block_ids) < 0 else block_ids


def row_settings(seq: Sequence) -> RowSettings:
    return RowSettings.of(seq.params, seq.seed, seq.num_prompt_tokens)


class PlanBuilder:
    def __init__(self, block_size: int, freed: list[int], num_groups: int = 1) -> None:
        self.block_size = block_size
        self.freed = freed  # the block manager's list of rows given back, drained into each plan
        self.owner = np.full(64, -1, dtype=np.int64)  # table_id each row was last described for
        self.sent = np.zeros(64, dtype=np.int64)  # leading blocks of that row already in a plan
        # the same for the other KV groups' tables (engine/kv_groups.py), which may hold released entries
        self.group_sent = [np.zeros(64, dtype=np.int64) for _ in range(num_groups - 1)]
        self.extras = ExtrasPlanner()
        self._last: StepPlan | None = None  # the last decode plan, and its entries
        self._last_seqs: list[Sequence] | None = None

    def _grow(self, rows: int) -> None:
        old = len(self.owner)
        self.owner = np.concatenate([self.owner, np.full(rows - old, -1, dtype=np.int64)])
        self.sent = np.concatenate([self.sent, np.zeros(rows - old, dtype=np.int64)])
        self.group_sent = [np.concatenate([sent, np.zeros(rows - old, dtype=np.int64)]) for sent in self.group_sent]

    def _rows(self, seqs: list[Sequence], rows: np.ndarray, plan: StepPlan) -> None:
        """New owners' settings and every row's unsent blocks, into ``plan``."""
        n = len(seqs)
        if n and int(rows.max()) >= len(self.owner):
            self._grow(max(2 * len(self.owner), int(rows.max()) + 1))
        ids = np.fromiter((s.table_id for s in seqs), np.int64, n)
        stale = np.flatnonzero(self.owner[rows] != ids)
        for i in stale.tolist():
            row = int(rows[i])
            self.owner[row], self.sent[row] = ids[i], 0
            for sent in self.group_sent:
                sent[row] = 0
            plan.new_rows.append((row, row_settings(seqs[i])))
        lens = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        which = self.sent[rows] < lens
        for g, sent in enumerate(self.group_sent, start=1):
            which |= sent[rows] < np.fromiter((len(s.block_tables[g]) for s in seqs), np.int64, n)
        self._blocks(seqs, rows, np.flatnonzero(which), plan)

    def _blocks(self, seqs: list[Sequence], rows: np.ndarray, which: np.ndarray, plan: StepPlan) -> None:
        sent = self.sent
        for i in which.tolist():
            row, table = int(rows[i]), seqs[i].block_table
            lo = int(sent[row])
            if lo < len(table):
                plan.blocks.append((row, lo, _valid(table[lo:])))
                sent[row] = len(table)
            for g, group_sent in enumerate(self.group_sent, start=1):
                table, lo = seqs[i].block_tables[g], int(group_sent[row])
                if lo < len(table):
                    plan.group_blocks.append((g, row, lo, _valid(table[lo:])))
                    group_sent[row] = len(table)

    def _take_freed(self) -> list[int]:
        """Rows given back since the last plan: described afresh when they are taken again."""
        if not self.freed:
            return []
        freed, self.freed[:] = list(self.freed), []
        if max(freed) >= len(self.owner):
            self._grow(max(2 * len(self.owner), max(freed) + 1))
        self.owner[freed] = -1
        return freed

    def decode(self, seqs: list[Sequence]) -> StepPlan:
        n = len(seqs)
        freed = self._take_freed()
        last = self._last
        if last is not None and seqs == self._last_seqs and seqs[0].pending_row == 0 \
                and seqs[-1].pending_row == n - 1:
            # every entry one token further, that token in flight in row i of the last step's output (a read
            # back in between would have cleared ``pending_row``); only rows whose token opens a block read
            # their sequence's block table
            computed = last.computed + 1
            plan = StepPlan(False, last.rows, computed, last.scheduled, np.arange(n, dtype=np.int64),
                            last.samples, np.zeros(n, dtype=np.int64), follows=True)
            grew = np.flatnonzero(computed % self.block_size == 0)
            if grew.size:
                self._blocks(seqs, last.rows, grew, plan)
        else:
            rows = np.fromiter((s.table_row for s in seqs), np.int64, n)
            computed = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n) - 1
            pending = np.fromiter((s.pending_row for s in seqs), np.int64, n)
            if bool((pending >= 0).all()):
                tokens = np.zeros(n, dtype=np.int64)  # every input token is filled in on the device
            else:
                tokens = np.fromiter((max(s.token_ids[-1], 0) for s in seqs), np.int64, n)
            plan = StepPlan(False, rows, computed, np.ones(n, dtype=np.int64), pending, np.ones(n, dtype=bool),
                            tokens)
            self._rows(seqs, rows, plan)
        self._last, self._last_seqs = plan, list(seqs)
        plan.freed, plan.extras = freed, self.extras.plan(seqs, seqs)
        return plan

    def prefill(self, seqs: list[Sequence], sampled: list[Sequence]) -> StepPlan:
        """A varlen step of chunks (a mixed step's decode entries first, as chunks of one token)."""
        self._last = self._last_seqs = None
        freed = self._take_freed()
        n = len(seqs)
        rows = np.fromiter((s.table_row for s in seqs), np.int64, n)
        computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        scheduled = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, n)
        totals = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        pending = np.fromiter((s.pending_row for s in seqs), np.int64, n)
        ends = computed + scheduled
        tokens: list[int] = []
        for s, a, b in zip(seqs, computed.tolist(), ends.tolist()):
            tokens += s.token_ids[a:b]
        flat = np.array(tokens, dtype=np.int64)
        samples = ends == totals
        in_flight = samples & (pending >= 0)
        if in_flight.any():  # the placeholder of a token still on the device: filled in there
            flat[np.cumsum(scheduled)[in_flight] - 1] = 0
        plan = StepPlan(True, rows, computed, scheduled, np.where(samples, pending, -1), samples, flat)
        self._rows(seqs, rows, plan)
        plan.freed, plan.extras = freed, self.extras.plan(seqs, sampled)
        return plan
