"""The runner's row table: what each block-table row needs across steps, refreshed only when it changes hands.

Keyed by the row a step plan names for each entry: the block tables (``BlockTables``: host array and
device copy; one per KV group, engine/kv_groups.py) and the sampling settings of the sequence holding the
row (temperature, min-p, top-p in float32 columns, top-k, seed, prompt length; the repetition, presence and
frequency penalties, whose token tables on the device are keyed by the same rows). A step gathers its rows'
settings with a few array lookups: the eager sampler as device tensors (``sampling``), the sampler inside the
decode graph as host rows staged with the graph's other inputs (``graph_sampling``). A new per-row setting of
the sampling path is one column here, one field of ``RowSettings`` and the sampler that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmcli.engine.block_tables import BlockTables, Deltas
from llmcli.engine.step_plan import RowSettings, StepPlan
from llmcli.engine.uploader import Uploader
from llmcli.layers.sampler import SamplingRows


@dataclass
class GraphSampling:
    """A decode step's sampling rows for the sampler inside the decode graph (``DecodeGraphs.staged_replay``)."""

    f32: np.ndarray  # float32 [temperatures, min_ps, top_ps] (cuda_graphs.F32_ROWS), one column per row
    top_ks: np.ndarray  # int64; <= 0: off
    seeds: np.ndarray
    steps: np.ndarray  # index of the token being generated
    filtered: bool  # some sampling (not greedy) row has top-k or top-p: the graph with the threshold kernel


def graph_sampling(f32: np.ndarray, top_ks: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> GraphSampling:
    sampling = f32[0] > 0
    if not sampling.any():  # all greedy: no noise, so no keys, and no filter changes an argmax
        n = f32.shape[1]
        return GraphSampling(f32, top_ks, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), False)
    filtered = bool((sampling & ((top_ks > 0) | (f32[2] < 1))).any())
    return GraphSampling(f32, top_ks, seeds, steps, filtered)


class RowTable:
    def __init__(self, max_blocks: int, block_size: int, device: torch.device, rows: int = 64,
                 copy: bool | None = None, groups: int = 1) -> None:
        # one table per KV group (engine/kv_groups.py); the first is ``block_tables``
        self.group_tables = [BlockTables(max_blocks, block_size, device, rows=rows, copy=copy) for _ in range(groups)]
        self.f32 = np.zeros((3, rows), dtype=np.float32)  # temperatures, min_ps, top_ps
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.prompt = np.zeros(rows, dtype=np.int64)
        self.pen = np.zeros((3, rows), dtype=np.float32)  # repetition, presence, frequency

    @property
    def block_tables(self) -> BlockTables:
        """The first KV group's tables (the only ones of most models)."""
        return self.group_tables[0]

    @block_tables.setter
    def block_tables(self, tables: BlockTables) -> None:
        self.group_tables[0] = tables

    def _grow(self, rows: int) -> None:
        old = self.top_k.shape[0]
        self.f32 = np.concatenate([self.f32, np.zeros((3, rows - old), dtype=np.float32)], axis=1)
        self.top_k = np.concatenate([self.top_k, np.zeros(rows - old, dtype=np.int64)])
        self.seed = np.concatenate([self.seed, np.zeros(rows - old, dtype=np.int64)])
        self.prompt = np.concatenate([self.prompt, np.zeros(rows - old, dtype=np.int64)])
        self.pen = np.concatenate([self.pen, np.zeros((3, rows - old), dtype=np.float32)], axis=1)

    def set(self, row: int, s: RowSettings) -> None:
        if row >= self.top_k.shape[0]:
            self._grow(max(2 * self.top_k.shape[0], row + 1))
        self.f32[:, row] = (s.temperature, s.min_p, s.top_p)
        self.top_k[row], self.seed[row], self.prompt[row] = s.top_k, s.seed, s.num_prompt_tokens
        self.pen[:, row] = (s.repetition_penalty, s.presence_penalty, s.frequency_penalty)

    def update(self, plan: StepPlan, uploader: Uploader, defer: bool = False) -> Deltas | None:
        """Take in the plan's rows that changed hands and its new blocks (the block tables' deltas: see
        ``BlockTables.write``)."""
        for row, settings in plan.new_rows:
            self.set(row, settings)
        if plan.group_blocks:  # the other KV groups' tables: a few rows a step each
            self._write_groups(plan, uploader)
        return self.block_tables.write(plan.blocks, uploader, defer)

    def _write_groups(self, plan: StepPlan, uploader: Uploader) -> None:
        """The other KV groups' deltas in two uploads for all of them: an upload a group (Gemma 4 has ten
        more) would wrap the uploader's ring of pinned buffers within one step, and its host would wait for the
        device's previous step there instead of running ahead of it."""
        by_group: dict[int, list[tuple[int, int, list[int]]]] = {}
        for group, row, lo, ids in plan.group_blocks:
            by_group.setdefault(group, []).append((row, lo, ids))
        sent = [(self.group_tables[g], d) for g, blocks in sorted(by_group.items())
                if (d := self.group_tables[g].write(blocks, uploader, defer=True)) is not None]
        if not sent:
            return
        index = uploader.upload(torch.int64, *(d[0] for _, d in sent))
        values = uploader.upload(torch.int32, *(d[1] for _, d in sent))
        for (tables, _), i, v in zip(sent, index, values):
            tables.apply(i, v)

    def sampled(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the plan's sampling entries, and the step of the token each of them draws."""
        rows, ends = plan.rows, plan.computed + plan.scheduled
        if plan.is_prefill:
            rows, ends = rows[plan.samples], ends[plan.samples]
        return rows, ends - self.prompt[rows]

    def penalties(self, rows: list[int], uploader: Uploader) -> tuple[torch.Tensor, ...]:
        """(repetition, presence, frequency) of ``rows`` on the device."""
        return tuple(uploader.upload(torch.float32, *self.pen[:, rows]))

    def all_greedy(self, rows: np.ndarray) -> bool:
        return not bool((self.f32[0, rows] > 0).any())

    def graph_sampling(self, rows: np.ndarray, steps: np.ndarray) -> GraphSampling:
        return graph_sampling(self.f32[:, rows], self.top_k[rows], self.seed[rows], steps)

    def sampling(self, rows: np.ndarray, steps: np.ndarray, uploader: Uploader) -> SamplingRows | None:
        """The sampler's rows on the device; None when every row is greedy (an argmax)."""
        if self.all_greedy(rows):
            return None
        f32, top_ks = self.f32[:, rows], self.top_k[rows]
        temps, min_ps, top_ps = uploader.upload(torch.float32, *f32)
        top_ks_t, seeds, steps_t = uploader.upload(torch.int64, top_ks, self.seed[rows], steps)
        return SamplingRows(temps, top_ks_t, top_ps, min_ps, seeds, steps_t,
                            use_filters=bool(((top_ks > 0) | (f32[2] < 1)).any()))
