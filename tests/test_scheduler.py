"""The scheduler driven alone (no model, no runner): the step plans it emits, which are all the runner sees.

The engine's side of a step is played by hand: ``Scheduler.launched`` after each plan (as the engine calls it
once the step is enqueued), and a read-back that puts the sampled token in place of its placeholder.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llmcli.engine.outputs import EngineStats
from llmcli.engine.scheduler import Scheduler
from llmcli.engine.sequence import PENDING_TOKEN, Sequence
from llmcli.sampling_params import SamplingParams

BS = 4


def scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, mixed: bool = True,
              caching: bool = False) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                             mixed_steps=mixed, kvcache_block_size=BS, enable_prefix_caching=caching)
    return Scheduler(config, num_blocks, EngineStats())


def request(sched: Scheduler, n: int, start: int = 10, **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    seq = Sequence(list(range(start, start + n)), SamplingParams(**params), BS, seed=7)
    sched.add(seq)
    return seq


def step(sched: Scheduler):
    """Schedule one step and record it as launched; returns (plan, batch)."""
    batch = sched.schedule()
    sched.launched(batch.seqs, batch.sampled)
    return batch.plan, batch


def read_back(batch, token: int = 3) -> None:
    """What the engine does when it reads a step's tokens back (no stop: every sequence goes on)."""
    for seq in batch.sampled:
        seq.token_ids[-1] = token
        seq.num_pending -= 1
        seq.pending_row = -1


def test_a_prefill_plan_carries_chunks_rows_settings_and_whole_tables():
    sched = scheduler(budget=12)
    a = request(sched, 5, temperature=0.7, top_k=5)
    b = request(sched, 10, start=50, temperature=0.0)
    plan, batch = step(sched)
    assert plan.is_prefill and batch.seqs == [a, b]
    assert plan.rows.tolist() == [a.table_row, b.table_row] == [0, 1]
    assert plan.computed.tolist() == [0, 0] and plan.scheduled.tolist() == [5, 7]  # b cut by the budget
    assert plan.tokens.tolist() == list(range(10, 15)) + list(range(50, 57))  # only the chunks' tokens
    assert plan.samples.tolist() == [True, False] and plan.num_sampled == 1
    assert plan.pending.tolist() == [-1, -1]
    settings = dict(plan.new_rows)
    assert sorted(settings) == [0, 1]
    assert (settings[0].temperature, settings[0].top_k, settings[0].seed, settings[0].num_prompt_tokens) == \
        (0.7, 5, 7, 5)
    assert settings[1].temperature == 0.0 and settings[1].num_prompt_tokens == 10
    assert plan.blocks == [(0, 0, a.block_table), (1, 0, b.block_table)]  # whole tables of new rows
    assert plan.extras is None and plan.freed == []

    # the next step: a decodes (its token in flight in row 0) beside the rest of b's prompt
    plan, batch = step(sched)
    assert plan.is_prefill and batch.num_decode == 1
    assert plan.rows.tolist() == [0, 1] and plan.computed.tolist() == [5, 7]
    assert plan.scheduled.tolist() == [1, 3] and plan.samples.tolist() == [True, True]
    assert plan.pending.tolist() == [0, -1]  # a's input is the token of row 0 of the last step's output
    assert plan.tokens.tolist() == [0, 57, 58, 59]  # the in-flight token is filled in on the device
    assert plan.new_rows == [] and plan.blocks == []  # nothing changed hands, no table grew


def test_decode_plans_follow_the_last_one_until_a_read_back():
    sched = scheduler()
    seqs = [request(sched, n, start=10 * n) for n in (3, 6)]
    _, first = step(sched)  # both prompts whole
    plan, _ = step(sched)  # decode, tokens of the prefill still in flight
    assert not plan.is_prefill and not plan.follows
    assert plan.rows.tolist() == [0, 1] and plan.computed.tolist() == [3, 6]
    assert plan.pending.tolist() == [0, 1] and plan.tokens.tolist() == [0, 0]
    # seq 0 opens block 1 (position 4): the block the scheduler gave it is all that crosses
    plan, batch = step(sched)
    assert plan.follows and plan.computed.tolist() == [4, 7] and plan.pending.tolist() == [0, 1]
    assert plan.blocks == [(0, 1, seqs[0].block_table[1:])] and len(seqs[0].block_table) == 2
    read_back(first)
    read_back(batch, token=9)
    plan, _ = step(sched)  # the engine read the last step back: the last tokens are known on the host
    assert not plan.follows and plan.pending.tolist() == [-1, -1] and plan.tokens.tolist() == [9, 9]
    assert plan.computed.tolist() == [5, 8]


def test_a_freed_row_is_named_and_described_afresh_when_taken_again():
    sched = scheduler()
    a = request(sched, 3)
    b = request(sched, 3, start=40)
    _, batch = step(sched)
    read_back(batch)
    sched.finish(a)
    c = request(sched, 6, start=80, temperature=1.0, seed=None)
    plan, _ = step(sched)  # b decodes, c takes a's row
    assert plan.freed == [0]
    assert c.table_row == 0 and plan.rows.tolist() == [b.table_row, 0]
    assert [row for row, _ in plan.new_rows] == [0] and plan.new_rows[0][1].temperature == 1.0
    assert (0, 0, c.block_table) in plan.blocks
    plan, _ = step(sched)
    assert plan.freed == [] and plan.new_rows == []


def test_preemption_frees_the_row_and_readmission_sends_the_table_again():
    sched = scheduler(num_blocks=4, mixed=False)  # 16 slots: two sequences of 7 outgrow them
    a = request(sched, 7)
    b = request(sched, 7, start=40)
    plans = []
    while not sched.stats.num_preemptions:
        plan, batch = step(sched)
        plans.append(plan)
        read_back(batch)
    assert b.table_row == -1 and b in sched.waiting  # the newest went back to the queue
    assert plans[-1].freed == [1] and plans[-1].rows.tolist() == [0]  # named in the plan of that very step
    sched.finish(a)
    plan, batch = step(sched)  # b again, from its tokens (the one it had generated included)
    assert plan.freed == [0]
    assert plan.is_prefill and plan.rows.tolist() == [b.table_row]
    assert plan.computed.tolist() == [0] and plan.tokens.tolist() == b.token_ids[:-1]  # (-1: this step's)
    assert [row for row, _ in plan.new_rows] == [b.table_row], "its row described afresh"
    assert plan.blocks == [(b.table_row, 0, b.block_table)], "its table sent anew"


def test_extras_cross_as_lists_only_when_a_request_asks():
    sched = scheduler()
    plain = request(sched, 3)
    asks = request(sched, 4, start=40, logprobs=2, repetition_penalty=1.5, min_tokens=3)
    asks.hold_ids = [2]
    plan, batch = step(sched)
    extras = plan.extras
    assert extras is not None
    assert extras.lp_rows == [1] and extras.lp_ks == [2]  # the second sampled row
    # the penalty tables' rows are the block-table rows; the values travel once, in the row's settings
    row = asks.table_row
    assert extras.pen_logit_rows == [1] and extras.pen_rows == [row]
    assert dict(plan.new_rows)[row].repetition_penalty == 1.5
    new, prompt_rows, prompt_ids = extras.pen_start
    assert new == [row] and prompt_rows == [row] * 4 and prompt_ids == asks.token_ids[:4]
    assert extras.hold == ([1], [2])
    read_back(batch)
    sched.finish(asks)
    plan, _ = step(sched)
    assert plan.extras is None and plain.table_row in plan.rows.tolist()


@pytest.mark.parametrize("mixed", [False, True])
def test_workers_plan_drops_what_only_sampling_reads(mixed):
    sched = scheduler(mixed=mixed)
    request(sched, 5, logprobs=1)
    plan, _ = step(sched)
    sent = plan.for_workers()
    assert sent.extras is None and sent.new_rows == []
    for name in ("rows", "computed", "scheduled", "pending", "samples", "tokens"):
        assert np.array_equal(getattr(sent, name), getattr(plan, name)), name
    assert sent.blocks == plan.blocks
    assert PENDING_TOKEN not in plan.tokens.tolist()
    # prompt logprobs: the workers' logits take part in each chunk's gather, so the rows travel (only they)
    scored = scheduler(mixed=mixed)
    request(scored, 5, prompt_logprobs=1, logprobs=1, repetition_penalty=1.2)
    plan, _ = step(scored)
    sent = plan.for_workers().extras
    assert sent.prompt_rows == plan.extras.prompt_rows == [0, 1, 2, 3]
    assert sent.prompt_targets == sent.lp_rows == sent.pen_rows == []


def test_a_preempted_sequence_queues_behind_a_prompt_cut_mid_prefill():
    """The cut prompt holds its blocks at the head of the queue; a preempted sequence put in front of it that
    cannot get blocks would stop every step (the engine hung)."""
    sched = scheduler(num_blocks=5, budget=8)
    a = request(sched, 7)  # two blocks; its second token needs a third
    plan, batch = step(sched)
    read_back(batch)
    b = request(sched, 12, start=50)  # three blocks, prefilled in chunks
    plan, batch = step(sched)  # a's first decode; b's first chunk takes the last free blocks
    read_back(batch)
    assert b.block_table and sched.block_manager.num_free_blocks == 0 and sched.waiting[0] is b
    batch = sched.schedule()  # a needs a block: it preempts itself, and queues behind b, which goes on
    assert sched.stats.num_preemptions == 1 and batch is not None and batch.seqs == [b]
    assert batch.plan.computed.tolist() == [7] and list(sched.waiting) == [a]


def _fill(sched: Scheduler, n: int, waiting: int) -> list[Sequence]:
    """``n`` requests running (decoding) and ``waiting`` more queued behind them; returns the running ones."""
    seqs = [request(sched, 2, start=10 + 4 * i) for i in range(n + waiting)]
    while len(sched.running) < n:
        _, batch = step(sched)
        read_back(batch)
    _, batch = step(sched)  # one decode step, every slot taken
    assert not batch.plan.is_prefill and len(sched.waiting) == waiting
    read_back(batch)
    return seqs[:n]


def test_prompts_start_in_groups_while_a_large_batch_decodes():
    """A prefill step while others decode costs a fixed overhead: a prompt waits until a sixteenth of the
    running batch can start with it (or every waiting one can), not one step per finished request."""
    from llmcli.engine.scheduler import GROUP_FRACTION

    sched = scheduler(num_blocks=512, budget=256, max_num_seqs=40)
    running = _fill(sched, 40, waiting=10)
    group = -(-(40 - 2) // GROUP_FRACTION)  # 3 when two have finished
    sched.finish(running[0])
    _, batch = step(sched)
    assert not batch.plan.is_prefill and len(sched.waiting) == 10  # one slot: held
    read_back(batch)
    sched.finish(running[1])
    _, batch = step(sched)
    assert not batch.plan.is_prefill  # two of three
    read_back(batch)
    sched.finish(running[2])
    _, batch = step(sched)
    assert batch.plan.is_prefill and batch.num_decode == 37 and len(batch.seqs) - 37 == group
    assert len(sched.waiting) == 10 - group


def test_a_held_prompt_starts_after_hold_steps_and_the_last_ones_at_once():
    from llmcli.engine.scheduler import HOLD_STEPS

    sched = scheduler(num_blocks=512, budget=256, max_num_seqs=40)
    running = _fill(sched, 40, waiting=3)
    sched.finish(running[0])
    for _ in range(HOLD_STEPS):
        _, batch = step(sched)
        assert not batch.plan.is_prefill
        read_back(batch)
    _, batch = step(sched)
    assert batch.plan.is_prefill and len(batch.seqs) == 40 and len(sched.waiting) == 2
    read_back(batch)
    # the two still waiting are every waiting prompt: they start as soon as both fit
    sched.finish(running[1])
    _, batch = step(sched)
    assert not batch.plan.is_prefill
    read_back(batch)
    sched.finish(running[2])
    _, batch = step(sched)
    assert batch.plan.is_prefill and len(batch.seqs) == 40 and not sched.waiting


def test_a_group_counts_kv_blocks_not_only_slots():
    """Short of KV blocks (slots to spare), a prompt waits for blocks enough for its group too."""
    sched = scheduler(num_blocks=20 + 3, budget=256, max_num_seqs=20)
    running = [request(sched, 1, start=10 + i) for i in range(20)]  # a block each
    _, batch = step(sched)
    read_back(batch)
    sched.max_num_seqs = 64
    for i in range(5):
        request(sched, 8, start=100 + 8 * i)  # two blocks each: the 3 free blocks hold one, not a group of 2
    _, batch = step(sched)
    assert not batch.plan.is_prefill and len(sched.waiting) == 5
    read_back(batch)
    sched.finish(running[0])  # a fourth block: the group of 2 (19 / 16, rounded up) fits
    _, batch = step(sched)
    assert batch.plan.is_prefill and len(batch.seqs) - batch.num_decode == 2 and len(sched.waiting) == 3


def test_a_group_is_no_larger_than_the_step_budget_holds():
    """Prompts longer than half the step's budget: a group of one, so each starts as soon as a slot frees (a
    group of three would wait for slots the step could not fill anyway)."""
    sched = scheduler(num_blocks=512, budget=64, max_num_seqs=40)
    running = _fill(sched, 40, waiting=0)
    for i in range(5):
        request(sched, 30, start=200 + 30 * i)  # the 25 tokens the budget leaves beside 39 decode rows: part of one
    sched.finish(running[0])
    _, batch = step(sched)
    assert batch.plan.is_prefill and len(batch.seqs) - batch.num_decode == 1
