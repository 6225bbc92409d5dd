"""The runner's row table (engine/row_table.py): what a block-table row holds across steps, refreshed from the
step plan only when the row changes hands or grows."""
from __future__ import annotations

import numpy as np
import torch

from llmcli.engine.row_table import RowTable
from llmcli.engine.step_plan import RowSettings, StepPlan
from llmcli.engine.uploader import Uploader

CPU = torch.device("cpu")
UP = Uploader(CPU)


def decode_plan(rows, computed, new_rows=(), blocks=()) -> StepPlan:
    n = len(rows)
    return StepPlan(False, np.array(rows), np.array(computed), np.ones(n, dtype=np.int64),
                    np.full(n, -1), np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64),
                    new_rows=list(new_rows), blocks=list(blocks))


def settings(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, prompt=4) -> RowSettings:
    return RowSettings(temperature, top_p, top_k, min_p, seed, prompt)


def test_settings_arrive_once_and_each_step_gathers_its_rows():
    table = RowTable(8, 4, CPU, rows=2)  # grows to row 5
    plan = decode_plan([5, 0], [10, 4], new_rows=[(5, settings(0.7, 0.9, 20, 0.1, 11, 6)), (0, settings())],
                       blocks=[(5, 0, [3, 4, 5]), (0, 0, [7, 8])])
    table.update(plan, UP)
    rows, steps = table.sampled(plan)
    assert rows.tolist() == [5, 0] and steps.tolist() == [11 - 6, 5 - 4]  # the index past the prompt
    got = table.sampling(rows, steps, UP)
    assert got is not None and got.use_filters
    assert torch.allclose(got.temperatures, torch.tensor([0.7, 0.0])) and got.top_ks.tolist() == [20, -1]
    assert torch.allclose(got.top_ps, torch.tensor([0.9, 1.0])) and torch.allclose(got.min_ps, torch.tensor([0.1, 0.0]))
    assert got.seeds.tolist() == [11, 0] and got.steps.tolist() == [5, 1]
    graph = table.graph_sampling(rows, steps)
    assert graph.filtered and graph.seeds.tolist() == [11, 0]
    # the block tables: slots of each row's positions
    assert table.block_tables.slots(np.array([5, 0]), np.array([10, 4])).tolist() == [5 * 4 + 2, 8 * 4 + 0]

    # a later step names no settings: the row keeps them; row 5 changes hands to a greedy request
    plan = decode_plan([5], [3], new_rows=[(5, settings(prompt=2))], blocks=[(5, 0, [9])])
    table.update(plan, UP)
    rows, steps = table.sampled(plan)
    assert table.sampling(rows, steps, UP) is None  # all greedy: an argmax, no sampler rows
    assert not table.graph_sampling(rows, steps).filtered
    assert table.block_tables.slots(np.array([5]), np.array([3])).tolist() == [9 * 4 + 3]


def test_prefill_steps_gather_only_the_sampling_entries():
    table = RowTable(8, 4, CPU)
    plan = StepPlan(True, np.array([1, 2]), np.array([0, 0]), np.array([3, 5]), np.full(2, -1),
                    np.array([False, True]), np.arange(8), new_rows=[(1, settings(1.0)), (2, settings(0.5, prompt=5))])
    table.update(plan, UP)
    rows, steps = table.sampled(plan)
    assert rows.tolist() == [2] and steps.tolist() == [0]
    assert torch.allclose(table.sampling(rows, steps, UP).temperatures, torch.tensor([0.5]))


def test_block_table_deltas_reach_the_device_copy():
    table = RowTable(6, 4, CPU, rows=1, copy=True)  # as on a GPU: a device copy kept by deltas
    deltas = table.update(decode_plan([0, 3], [1, 1], blocks=[(0, 0, [4, 5]), (3, 0, [6])]), UP, defer=True)
    index, values = deltas
    assert values.tolist() == [4, 5, 6] and index.tolist() == [0, 1, 3 * 6]
    table.block_tables.apply(torch.from_numpy(index), torch.from_numpy(values))
    table.update(decode_plan([0], [8], blocks=[(0, 2, [7])]), UP)  # sent at once (not deferred)
    assert table.block_tables.table[0, :3].tolist() == [4, 5, 7] and table.block_tables.table[3, 0] == 6
    try:
        table.update(decode_plan([0], [1], blocks=[(0, 3, [1, 2, 3, 4])]), UP)
    except ValueError as exc:
        assert "does not fit" in str(exc)
    else:
        raise AssertionError("a table wider than max_model_len's columns must be refused")
