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


def test_every_kv_groups_deltas_cross_in_two_uploads():
    """Gemma 4-31B's eleven KV groups: a decode step where sequences cross a block boundary adds a block to each
    group's table. All groups' deltas go in one upload of indices and one of block ids (an upload a group wrapped
    the 16 pinned buffers of the uploader's ring within a step on the GPU, making the host wait for the device:
    19 ms a step, benchmarks/RESULTS.md N4), and every group's device copy equals its host table."""
    class Counting(Uploader):
        calls = 0

        def upload(self, dtype, *parts):
            Counting.calls += 1
            return super().upload(dtype, *parts)

    table = RowTable(6, 4, CPU, rows=4, copy=True, groups=11)
    plan = decode_plan([0, 2], [4, 8], blocks=[(0, 1, [5]), (2, 2, [9])])
    plan.group_blocks = [(g, row, lo, [100 * g + row]) for g in range(1, 11) for row, lo in ((0, 1), (2, 2))]
    table.update(plan, Counting(CPU))
    assert Counting.calls == 2 + 2  # group 0's own pair, then the other ten groups' together
    for g, tables in enumerate(table.group_tables):
        assert torch.equal(tables.table, torch.from_numpy(tables.host)), g
        if g:
            assert tables.host[0, 1] == 100 * g and tables.host[2, 2] == 100 * g + 2


def test_penalty_values_arrive_with_the_row_and_are_gathered_by_row():
    """Repetition, presence and frequency are row-table columns, set once when a row changes hands: a step's
    extras carry only which rows are penalised, not their values."""
    table = RowTable(8, 4, CPU, rows=2)
    pen = RowSettings(0.0, 1.0, -1, 0.0, 0, 4, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.2)
    table.update(decode_plan([5, 0], [4, 4], new_rows=[(5, pen), (0, settings())]), UP)
    rep, pres, freq = table.penalties([5, 0, 5], UP)
    assert torch.allclose(rep, torch.tensor([1.3, 1.0, 1.3])) and torch.allclose(pres, torch.tensor([0.5, 0.0, 0.5]))
    assert torch.allclose(freq, torch.tensor([-0.2, 0.0, -0.2]))
    table.update(decode_plan([5], [5]), UP)  # a later step names no settings: the row keeps its values
    assert torch.allclose(table.penalties([5], UP)[0], torch.tensor([1.3]))
    table.update(decode_plan([5], [3], new_rows=[(5, settings())]), UP)  # row 5 changes hands
    assert [t.tolist() for t in table.penalties([5], UP)] == [[1.0], [0.0], [0.0]]


def test_token_tables_are_keyed_by_block_table_row_and_refilled_when_the_row_changes_hands():
    """The penalty and bias token tables on the device use the sequence's block-table row: a sequence keeps
    its row (and counts) while it holds the allocation; a new allocation of the row (another request, or
    the same one admitted again after preemption) is cleared and filled afresh."""
    from llmcli.engine.extras_plan import ExtrasPlanner
    from llmcli.engine.sequence import Sequence
    from llmcli.sampling_params import SamplingParams

    params = SamplingParams(repetition_penalty=1.5, logit_bias={7: 2.0}, max_tokens=8)
    a = Sequence([1, 2, 3], params, 4)
    a.table_row, a.table_id = 6, 1
    planner = ExtrasPlanner()
    first = planner.plan([a], [a])
    assert first.pen_rows == [6] and first.pen_start == ([6], [6, 6, 6], [1, 2, 3]) and first.pen_slots == 7
    assert first.bias_rows == [6] and first.bias_start[0] == [6] and first.bias_slots == 7
    a.token_ids.append(9)  # one generated token: counted from the step's input row, no restart
    a.num_scheduled_tokens = 1
    again = planner.plan([a], [a])
    assert again.pen_start == ([], [], []) and again.bias_start == ()
    assert again.pen_from_input == ([6], [0]) and again.pen_known == ([], [])
    b = Sequence([4, 5], params, 4)  # a new request takes row 6
    b.table_row, b.table_id = 6, 2
    fresh = planner.plan([b], [b])
    assert fresh.pen_start == ([6], [6, 6], [4, 5]) and fresh.bias_start[0] == [6]
    a.table_row, a.table_id = 6, 3  # a, admitted again after preemption: its generated token counted again
    a.num_scheduled_tokens = 1
    back = planner.plan([a], [a])
    assert back.pen_start == ([6], [6, 6, 6], [1, 2, 3]) and back.pen_from_input == ([6], [0])
