"""A hybrid model's pool: state rows of pages beside KV blocks in one buffer (engine/state_pages.py).

The block manager alone (which pages go where), then the engine on a tiny Qwen3.5 against transformers: with the
pool sized from memory (shared), long prompts hold more KV blocks than every row's states would leave them, and
the tokens stay transformers'.
"""
from __future__ import annotations

import pytest

from llmcli.engine.block_manager import BlockManager
from llmcli.engine.sequence import Sequence
from llmcli.engine.state_pages import StatePages
from llmcli.sampling_params import SamplingParams
from test_engine_vs_hf import check_against_hf, random_prompts, run_factory  # noqa: F401 (a fixture)

BS = 4
ROW = 3  # pages a row's states take


def seq_of(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=8), BS)


def manager(num_pages: int = 40, seq_rows: int = 4, fixed_rows: int = 2, shared: bool = True,
            caching: bool = True) -> BlockManager:
    """Rows 0-3 on pages 0-11, the fixed rows on 12-17, KV-only pages 18 on."""
    return BlockManager(num_pages, BS, caching, state_pages=StatePages(ROW, seq_rows, fixed_rows, shared))


def pages_of(row: int) -> set[int]:
    return set(range(row * ROW, (row + 1) * ROW))


def test_rows_from_the_bottom_kv_from_the_top_and_everything_back():
    m = manager()
    assert m.num_blocks == 40 - 2 * ROW and m.num_free_blocks == m.num_blocks
    a, b = seq_of(10), seq_of(6, start=100)
    m.allocate(a)
    m.allocate(b)
    assert (a.table_row, b.table_row) == (0, 1)
    assert a.block_table == [39, 38, 37] and b.block_table == [36, 35]  # highest free pages first
    assert m.num_free_blocks == m.num_blocks - 2 * ROW - 5
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == m.num_blocks
    c = seq_of(5, start=200)
    m.allocate(c)
    assert c.table_row == 0, "the lowest free row again"


def test_kv_fills_free_rows_pages_and_a_row_under_kv_in_use_is_not_claimed():
    m = manager()
    big = seq_of(4 * (40 - 2 * ROW - ROW - ROW))  # every free page but two rows': KV reaches into rows 2 and 3
    m.allocate(big)
    assert big.table_row == 0
    held = set(big.block_table)
    assert held & pages_of(3) and held & pages_of(2) and not held & pages_of(1), "KV came down into the rows"
    assert not held & set(range(4 * ROW, 6 * ROW)), "the fixed rows are never KV"
    assert m.num_free_blocks == ROW
    small = seq_of(1, start=500)
    assert not m.can_allocate(small), "row 1 is free but its pages are the last free KV ones"
    assert m.admissible([small], 4) == 0
    m.free(big)
    assert m.can_allocate(small) and m.admissible([small, seq_of(1), seq_of(1), seq_of(1), seq_of(1)], 5) == 4


def test_a_row_whose_pages_hold_kv_in_use_is_skipped_for_a_higher_one():
    m = manager(num_pages=6 * ROW + 1, shared=True)  # one KV-only page
    a = seq_of(4 * 3)  # three blocks: the KV-only page, then row 3's pages
    m.allocate(a)
    assert set(a.block_table) == {18, 11, 10} and a.table_row == 0
    b = seq_of(4, start=50)
    m.allocate(b)
    assert b.table_row == 1 and b.block_table == [9]
    m.free(a)  # row 0 and row 3's pages free again; b's KV block is in row 3
    c, d = seq_of(1, start=60), seq_of(1, start=70)
    m.allocate(c)
    m.allocate(d)
    assert (c.table_row, d.table_row) == (0, 2), "row 3 holds b's block: rows 0 and 2"
    assert not {*c.block_table, *d.block_table} & (pages_of(0) | pages_of(2))


def test_claiming_a_row_evicts_the_cached_blocks_on_its_pages():
    m = manager(num_pages=6 * ROW + 6)  # six KV-only pages, 18-23
    filler = seq_of(4 * 6)
    m.allocate(filler)  # row 0; the KV-only pages
    shared = list(range(16))  # four full blocks
    a = Sequence(shared + [99], SamplingParams(max_tokens=8), BS)
    m.allocate(a)  # row 1; its blocks come down into rows 3 and 2
    a.num_computed_tokens = a.num_tokens
    m.register_computed(a)
    assert a.block_table == [11, 10, 9, 8, 7]
    m.free(a)
    m.free(filler)
    again = Sequence(shared + [98], SamplingParams(max_tokens=8), BS)
    assert m.cached_blocks(again) == 4
    short = [seq_of(1, start=1000 + i) for i in range(4)]
    for s in short[:3]:
        m.allocate(s)
    assert [s.table_row for s in short[:3]] == [0, 1, 2] and m.cached_blocks(again) == 3, "page 8 went to row 2"
    m.allocate(short[3])
    assert short[3].table_row == 3 and m.cached_blocks(again) == 0, "a claimed row's pages hold no findable block"
    assert all(s.block_table[0] >= 18 for s in short), "their KV on the KV-only pages"


def test_cached_blocks_outlive_never_cached_ones():
    """Freed blocks that hold a cached prefix are handed out after the never-cached ones, the deepest first."""
    m = manager(num_pages=6 * ROW + 6, shared=False)  # KV on pages 18-23 alone
    a = Sequence(list(range(8)) + [7], SamplingParams(max_tokens=8), BS)
    m.allocate(a)
    a.num_computed_tokens = a.num_tokens
    m.register_computed(a)
    m.free(a)
    query = Sequence(list(range(8)) + [5], SamplingParams(max_tokens=8), BS)
    m.allocate(seq_of(16, start=100))  # four blocks: every free page but the two cached ones
    assert m.num_free_blocks == 2 and m.cached_blocks(query) == 2
    m.allocate(seq_of(4, start=200))
    assert m.cached_blocks(query) == 1, "the prefix's second block went first"


def test_static_rows_keep_their_pages():
    m = manager(shared=False)
    assert m.num_blocks == 40 - 6 * ROW
    big = seq_of(4 * m.num_blocks)
    m.allocate(big)
    assert min(big.block_table) == 6 * ROW, "KV never on a row's pages"
    assert m.can_allocate(seq_of(1, start=7)) is False
    m.free(big)
    assert m.can_allocate(seq_of(4 * m.num_blocks)), "a static row costs no KV block"


def test_requests_longer_than_the_room_beside_their_states_are_refused():
    from llmcli.engine.state_pages import kv_room_of

    pages = StatePages(ROW, 4, 2, True)
    report = type("R", (), {"state_pages": pages})()
    assert kv_room_of(report, 40) == 40 - 2 * ROW - ROW
    assert kv_room_of(type("R", (), {"state_pages": StatePages(ROW, 4, 2, False)})(), 40) == 40 - 6 * ROW
    assert kv_room_of(None, 40) == 40


@pytest.mark.parametrize("shared", [False, True])
def test_long_prompts_borrow_the_pages_of_rows_no_sequence_holds(shared, tiny_checkpoint, hf_oracle, run_factory):
    """The same pages either way: static reserves every row (9 sequence rows, 4 snapshot rows, a scratch row)
    and leaves 30 KV blocks; shared lends the sequences' rows to KV while no sequence holds them, so more of the
    long prompts run at once, and both equal transformers."""
    model = tiny_checkpoint("qwen3.5")
    first = run_factory(model, kvcache_block_size=16, max_num_seqs=8).llm.engine.model_runner.memory_report
    row_pages, page = first.state_pages.row_pages, first.kv_bytes_per_block
    total = 30 + (9 + 5) * row_pages
    pool = dict(num_kvcache_blocks=None, kv_cache_memory_gib=total * page / 2**30) if shared \
        else dict(num_kvcache_blocks=30)
    run = run_factory(model, kvcache_block_size=16, max_num_seqs=8, max_model_len=192, max_num_batched_tokens=64,
                      **pool)
    engine = run.llm.engine
    assert engine.model_runner.memory_report.num_blocks == total
    prompts = random_prompts([100] * 8, seed=460)  # 7 blocks each, 9 with 40 new tokens
    check_against_hf(run, hf_oracle, prompts, max_new=40)
    peak = engine.stats.peak_running
    if shared:  # (30 + 9 x rows) / (9 + rows) at once against 30 / 9
        assert peak >= 5, peak
    else:
        assert peak <= 4, peak
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_states_are_views_of_the_kv_buffer(tiny_checkpoint, run_factory):
    """Every linear layer's conv and recurrent state lies in the one KV buffer, rows ``row_pages`` pages apart,
    and no two layers' states (nor a row's and a KV block's of another row) overlap."""
    run = run_factory(tiny_checkpoint("qwen3.5"), kvcache_block_size=16, max_num_seqs=4, num_kvcache_blocks=None,
                      kv_cache_memory_gib=0.002)
    runner = run.llm.engine.model_runner
    buffer, pages = runner.kv_cache, runner.state_pages
    base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    page = buffer.shape[1]
    spans = []
    for t in runner.state_pool:
        assert base <= t.data_ptr() and t.stride(0) * t.element_size() == pages.row_pages * page
        first = t[0]
        lo = first.data_ptr()
        hi = lo + max((s - 1) * st for s, st in zip(first.shape, first.stride())) * t.element_size() + t.element_size()
        spans.append((lo, hi))
        last = t[-1]
        assert last.data_ptr() < end
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two states of a row overlap"
    assert spans[-1][1] - base <= pages.row_pages * page, "a row spills into the next row's pages"


@pytest.mark.parametrize("shared", [True, False])
def test_random_admissions_growth_and_frees_keep_rows_and_kv_apart(shared):
    """Many random runs of what the scheduler does (admit when it can, grow a block at a time, preempt the newest
    when short, finish at random, with prefix hits): no page is ever both a held row's and a KV block in use, the
    fixed rows' pages are never KV, the counts agree with the pages, and everything comes back."""
    import random

    rng = random.Random(7)
    m = manager(num_pages=70, seq_rows=6, fixed_rows=2, shared=shared)
    prefixes = [list(range(100 * k, 100 * k + 12)) for k in range(3)]
    running: list[Sequence] = []
    for step in range(3000):
        if rng.random() < 0.3:
            seq = Sequence(rng.choice(prefixes) + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 20))],
                           SamplingParams(max_tokens=64), BS)
            if m.can_allocate(seq):
                m.allocate(seq, max_cached_blocks=None)
                seq.num_computed_tokens = seq.num_tokens
                m.register_computed(seq)
                running.append(seq)
        for seq in list(running):
            if seq not in running:
                continue
            seq.token_ids.append(rng.randrange(1000, 2000))
            while seq.num_blocks > len(seq.block_table) and not m.can_append(seq):
                victim = running.pop()
                m.free(victim)
                if victim is seq:
                    break
            if seq in running:
                m.append_slot(seq)
                seq.num_computed_tokens = seq.num_tokens - 1
        if running and rng.random() < 0.2:
            m.free(running.pop(rng.randrange(len(running))))
        held_rows = {s.table_row for s in running}
        assert len(held_rows) == len(running)
        kv = [b for s in running for b in s.block_table]
        row_pages = {p for r in held_rows for p in pages_of(r)} if shared else set(range(8 * ROW))
        assert not set(kv) & row_pages, f"step {step}: a KV block on a held row's pages"
        assert not set(kv) & set(range(6 * ROW, 8 * ROW)), "a fixed row's page as KV"
        in_use = {b for b in kv}
        assert m.num_free_blocks == m.num_blocks - len(in_use) - (len(held_rows) * ROW if shared else 0)
        if shared:
            assert m.state_rows.busy == [len(in_use & pages_of(r)) for r in range(6)]
    for seq in running:
        m.free(seq)
    assert m.num_free_blocks == m.num_blocks
