"""The runner's block tables (engine/block_tables.py): the device copy, kept by deltas, equals every live table."""
from __future__ import annotations

import random

import numpy as np
import torch

from llmcli.engine.block_manager import BlockManager
from llmcli.engine.block_tables import BlockTables
from llmcli.engine.plan_builder import PlanBuilder
from llmcli.engine.sequence import Sequence
from llmcli.engine.uploader import Uploader
from llmcli.sampling_params import SamplingParams

BS = 4


def test_device_copy_follows_allocations_growth_frees_and_reused_rows():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=400, block_size=BS, enable_prefix_caching=False)
    tables = BlockTables(max_blocks=40, block_size=BS, device=torch.device("cpu"), rows=2, copy=True)  # rows grow
    plans = PlanBuilder(BS, manager.freed_rows)  # what crosses to the runner: rows that changed hands, new blocks
    uploader = Uploader(torch.device("cpu"))
    live: list[Sequence] = []
    for step in range(300):
        action = rng.random()
        if action < 0.15 or not live:  # a new sequence
            seq = Sequence([rng.randrange(100) for _ in range(rng.randint(1, 30))], SamplingParams(), BS)
            if manager.can_allocate(seq):
                manager.allocate(seq)
                live.append(seq)
        elif action < 0.25:  # a finish or a preemption: its row goes back and is handed out again
            seq = live.pop(rng.randrange(len(live)))
            manager.free(seq)
        for seq in [s for s in live if s.num_tokens >= 150]:  # at the length limit (40 blocks of 4)
            live.remove(seq)
            manager.free(seq)
        for seq in live:  # every live sequence decodes a token
            seq.append_token(rng.randrange(100))
            if manager.can_append(seq):
                manager.append_slot(seq)
        batch = [s for s in live if len(s.block_table) == s.num_blocks]
        if not batch:
            continue
        plan = plans.prefill(batch, [])
        rows = plan.rows
        tables.write(plan.blocks, uploader)
        got = tables.gather(torch.from_numpy(rows))
        assert not np.shares_memory(tables.host, tables.table.numpy())
        for seq, row in zip(batch, got):
            assert row[:len(seq.block_table)].tolist() == seq.block_table, f"step {step}"
    assert tables.host.shape[0] > 2  # it grew
    assert len({s.table_row for s in live}) == len(live)
